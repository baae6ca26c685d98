"""The calibration's pure parts: the cluster a bench run is simulated on, and the YAML it writes.

Measuring the constants and running the check configurations need a quiet
machine and take minutes (``wt simulate --calibrate --check``); what is tested
here is that the simulated cluster is the one ``wt bench pipeline`` runs (caps,
buckets, shared cores, no gathers) and that written constants load back.
"""

from pathlib import Path

import pytest

from actors.tools.bench.calibrate import CHECK_CONFIGS, bench_cluster, write_sim
from scheduling.cluster.config import load_cluster_config

ROOT = Path(__file__).resolve().parents[2]
CONSTANTS = {"copy_gbps": 4.0, "fp8_quant_gbps": 0.5, "intra_node_gbps": 1.5,
             "gather_latency_us": 80.0, "write_overhead_us": 120.0, "cpu_cores": 2.0,
             "param_overhead_us": 900.0}


@pytest.mark.parametrize("serial", [False, True])
def test_bench_cluster_is_what_the_bench_runs(serial):
    base = load_cluster_config(ROOT / "configs/clusters/bench_pipeline.yaml")
    cl = bench_cluster(base, CONSTANTS, cap=0.2, serial=serial, watermark=512 << 20,
                       bucket_bytes=16 << 20)
    sim = cl.sim
    assert cl.trainer.nic_gbps == pytest.approx(1.6)  # 0.2 GB/s in Gb/s
    assert cl.inference.nic_gbps == pytest.approx(32.0)  # engines at memcpy speed
    assert (sim.gathers, sim.h2d_gbps) == (False, None)  # plain tensors, already in memory
    assert (sim.cpu_cores, sim.write_copy_gbps) == (2.0, 4.0)  # one host, simnic copies
    assert (sim.gather_mode, sim.bucket_bytes) == ("bucket", 16 << 20)
    assert (sim.watermark_bytes, sim.max_inflight) == ((1, 1) if serial else (512 << 20, 4))
    assert (sim.fp8_quant_gbps, sim.write_overhead_us, sim.param_overhead_us) == (0.5, 120.0,
                                                                                   900.0)


def test_write_sim_replaces_measured_keys_and_keeps_the_rest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text((ROOT / "configs/clusters/local_cpu.yaml").read_text())
    write_sim(path, CONSTANTS)
    write_sim(path, {**CONSTANTS, "cpu_cores": 4.0})  # twice: replaced, not duplicated
    text = path.read_text()
    assert text.count("cpu_cores:") == 1
    cl = load_cluster_config(path)
    assert cl.sim.cpu_cores == 4.0 and cl.sim.max_inflight == 4  # kept from the file
    assert cl.sim.fp8_quant_gbps == 0.5 and cl.name == "local_cpu"


def test_check_configurations_differ_in_model_cap_and_ranks():
    models = {c[0] for c in CHECK_CONFIGS}
    caps = {c[2] for c in CHECK_CONFIGS}
    clusters = {c[4] for c in CHECK_CONFIGS}
    assert len(models) >= 2 and len(caps) >= 2 and len(clusters) >= 2
    for c in CHECK_CONFIGS:
        if c[4] is not None:
            assert (ROOT / "configs/clusters" / f"{c[4]}.yaml").exists(), c
