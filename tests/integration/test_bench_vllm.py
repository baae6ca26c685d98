"""``wt bench designs --engine vllm`` and ``wt bench stall --engine vllm`` end to end on
tiny_llama, both on one fleet handed to them (``fleet=``): 2 FSDP2 trainer ranks -> one
real vLLM replica x TP1 (the vLLM demo's fleet, as ``wt bench designs --engine vllm
--config configs/runs/bench_vllm_tp1.yaml`` starts it: the smoke run of the bench's TP2
config; TP is not what the benches measure, and TP2's shared-memory queues spin a core
per worker), on the shared Ray cluster.

* designs: every design once with NIC caps on. Each design's engine state is verified
  byte for byte against vLLM's own ``load_weights`` of the trainers' weights, after every
  registered engine byte was zeroed before the update; the baselines load with vLLM's
  ``load_weights`` inside its workers.
* stall, after it (its shadow mode leaves the engine set up for shadow mode, so it runs
  last; its versions go on above the designs'): one update per mode while a client
  generates continuously. Every update is verified against vLLM's own ``load_weights`` of
  the trainers' weights (both modes), the JSON has the reference bench's shape, and the
  stalls are vLLM's own engine-step gaps.
* the stall bench's defaults: one replica at TP2, at TP1 through ``--cluster``.

One engine start. Speed is never asserted (two shared cores): only that each design
verified, that the designs JSON has the reference bench's keys plus ``"engine": "vllm"``,
and that the numbers are real (steps were timed around every update, shadow mode states
its memory, in place adds none).
"""

from __future__ import annotations

import json
import math

import pytest

from actors.tools.bench.designs.bench import bench_run_config
from actors.tools.bench.designs.bench import run as run_designs
from actors.tools.bench.stall.bench import run as run_stall
from actors.tools.bench.stall.bench import run_config_for
from actors.tools.demo.run_config import ROOT

# Skipped where vLLM cannot be imported (tests/conftest.py). Every test on the shared
# cluster, so that it outlives the module's fleet (conftest.py stops it after the last).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.usefixtures("ray_job")]

CONFIG = ROOT / "configs/runs/bench_vllm_tp1.yaml"
MODEL = ROOT / "configs/models/tiny_llama.yaml"
NIC_GBPS = 0.5
TP1 = ROOT / "configs" / "clusters" / "vllm_cpu_tp1.yaml"
DESIGNS = ("p2p", "rank0", "rpc", "bucketed")


@pytest.fixture(scope="module")
def fleet(ray_job):
    """The fleet ``wt bench designs --engine vllm`` would start; both benches run on it."""
    from actors.tools.demo.vllm_demo import start_fleet

    fleet = start_fleet(bench_run_config(CONFIG, MODEL, NIC_GBPS, "vllm"))
    try:
        yield fleet
    finally:
        fleet.close()


def test_every_design_verified_against_vllm_on_tiny_llama(tmp_path, fleet):
    out = tmp_path / "designs.json"
    rc = run_designs(engine="vllm", config=CONFIG, model=MODEL, nic_gbps=NIC_GBPS, updates=1,
                     designs=",".join(DESIGNS), bucket="1M", caps_off=False, timeout_s=300.0,
                     json_path=out, png=None, fleet=fleet)
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    assert {"results", "lower_bound_s", "passes", "memcpy_gbps", "bytes"} <= set(doc)
    assert (doc["engine"], doc["model"]) == ("vllm", "tiny-llama")
    assert set(doc["results"]) == set(DESIGNS)
    details = doc["passes"]["caps_on"]["results"]
    for design in DESIGNS:
        assert details[design]["ok"], details[design]
        assert details[design]["problems"] == []
        assert math.isfinite(doc["results"][design]) and doc["results"][design] > 0
        assert details[design]["busiest_nic_bytes"] > 0
    assert 0 < doc["lower_bound_s"] < doc["results"]["p2p"]
    # the broadcast designs move each Hugging Face tensor once per engine rank in the tree:
    # trainer rank 0 sends the whole model (bf16) at least once
    model_bytes = doc["bytes"] // 2  # ours writes float32 engine tensors, TP1: 2x bf16
    assert details["rank0"]["busiest_nic_bytes"] >= model_bytes
    assert details["bucketed"]["busiest_nic_bytes"] >= model_bytes


def test_both_stall_modes_verified_on_vllm(tmp_path, fleet):  # after the designs: see above
    out = tmp_path / "stall.json"
    rc = run_stall(config=None, engine="vllm", updates=1, json_out=out, fleet=fleet)
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["verified"] is True, doc
    assert (doc["engine"], set(doc["modes"])) == ("vllm", {"in_place", "shadow"})
    for mode in ("in_place", "shadow"):
        row = doc["modes"][mode]
        assert row["verified"] and row["problems"] == [], row
        assert len(row["stalls"]) == len(row["updates"]) == 1
        assert math.isfinite(row["stall_s"]) and row["stall_s"] > 0
        assert 0 < row["step_gap_s"] <= row["stall_s"]
        assert row["idle_stall_s"] > 0  # vLLM stepped through the idle window too
        assert row["engine_pause_s"] > 0 and row["update_s"] > 0
    assert doc["modes"]["in_place"]["extra_engine_bytes"] == 0
    assert doc["modes"]["shadow"]["extra_engine_bytes"] > 0


def test_the_vllm_stall_bench_defaults_to_one_replica_tp2():
    run_cfg = run_config_for(None, "vllm")
    assert run_cfg.engine == "vllm" and run_cfg.cluster.name == "vllm_cpu.yaml"
    tp1 = run_config_for(None, "vllm", TP1)  # `wt bench stall --cluster`
    assert (tp1.engine, tp1.name, tp1.cluster) == ("vllm", run_cfg.name, TP1)
