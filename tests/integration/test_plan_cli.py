"""``wt plan`` and ``wt simulate`` as a user runs them: exit codes, printed summary, JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.model.models import load_model_config

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs/models/tiny_deepseek_v3.yaml"
CLUSTER = ROOT / "configs/clusters/local_cpu.yaml"


def wt(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "actors.tools.cli.main", *map(str, args)],
                          cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def test_plan_prints_and_writes_the_summary(tmp_path):
    out = tmp_path / "plan.json"
    r = wt("plan", "--model", MODEL, "--cluster", CLUSTER, "--json", out)
    assert r.returncode == 0, r.stderr
    assert "NIC lower bound" in r.stdout and "time to plan" in r.stdout
    s = json.loads(out.read_text())
    cfg, cl = load_model_config(MODEL), load_cluster_config(CLUSTER)
    plan = compute_plan(trainer_meta_from_config(cfg, cl), engine_metas_from_config(cfg, cl),
                        cl, model=cfg)
    assert s["tasks"] == plan.num_tasks
    assert s["bytes_total"] == plan.bytes_total
    busiest = max(plan.send_bytes().sum(axis=0).max() / cl.send_bytes_per_s,
                  plan.recv_bytes().sum(axis=0).max() / cl.recv_bytes_per_s)
    assert abs(s["lower_bound_s"] - busiest) < 1e-12
    assert 1.0 <= s["nic_imbalance"] == max(s["send_imbalance"], s["recv_imbalance"])
    assert s["plan_seconds"] > 0 and s["peak_rss_bytes"] > 0 and s["validate_seconds"] >= 0


def test_simulate_reports_prediction_beside_bound(tmp_path):
    out = tmp_path / "sim.json"
    r = wt("simulate", "--model", MODEL, "--cluster", CLUSTER, "--json", out, "--inflight", "2")
    assert r.returncode == 0, r.stderr
    assert "predicted transfer" in r.stdout
    s = json.loads(out.read_text())
    assert s["predicted_s"] >= s["barrier_lower_bound_s"] * (1 - 1e-9)
    assert s["barrier_lower_bound_s"] >= s["lower_bound_s"] * (1 - 1e-9)
    assert s["max_inflight"] == 2 and len(s["group_seconds"]) == s["groups"]
    stages = {"h2d", "gather", "prepare", "write"}
    assert set(s["stages"]) == stages and s["binding"] in stages | {"cpu"}
    assert len(s["group_binding"]) == s["groups"] and set(s["group_binding"]) <= stages | {"cpu"}


def test_simulate_calibrate_measures_and_writes_the_constants_from_any_directory(tmp_path):
    """``wt simulate --calibrate --write-sim`` run outside the repository (the configs it
    measures with ship with the package): the constants measured, written into a copy of
    the cluster file that still loads, and the simulation run on it."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER.read_text())
    out = tmp_path / "sim.json"
    r = wt("simulate", "--calibrate", "--model", ROOT / "configs/models/tiny_llama.yaml",
           "--cluster", cluster, "--write-sim", cluster, "--json", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    constants = json.loads(out.read_text())["calibration"]["constants"]
    assert set(constants) == {"copy_gbps", "fp8_quant_gbps", "intra_node_gbps",
                              "gather_latency_us", "write_overhead_us", "cpu_cores",
                              "param_overhead_us"}
    assert all(v > 0 for v in constants.values()), constants
    sim = load_cluster_config(cluster).sim
    assert sim.copy_gbps == constants["copy_gbps"]
    assert sim.param_overhead_us == constants["param_overhead_us"]


def test_bad_cluster_file_is_named_with_its_field(tmp_path):
    bad = yaml.safe_load(CLUSTER.read_text())
    bad["inference"]["tensor_parallel"] = 3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    r = wt("plan", "--model", MODEL, "--cluster", path)
    assert r.returncode == 2
    text = " ".join(r.stdout.split())
    assert "bad.yaml" in text and "tensor_parallel=3 must equal gpus_per_replica=2" in text
