"""``wt bench stall --engine vllm`` end to end: 2 FSDP2 trainer ranks -> one real vLLM replica
(the vLLM demo's fleet, at TP1 through ``--cluster``: the bench's default is TP2, whose
shared-memory queues spin a core per worker; TP is not what the bench measures), one update
per mode while a client generates continuously.
Every update is verified against vLLM's own ``load_weights`` of the trainers' weights (both
modes), the JSON has the reference bench's shape, and the stalls are vLLM's own engine-step
gaps. One engine start.

Speed is never asserted (two shared cores): only that the numbers are real (steps were
timed around every update, shadow mode states its memory, in place adds none).
"""

from __future__ import annotations

import json
import math

import pytest

from actors.tools.bench.stall.bench import run, run_config_for
from actors.tools.demo.run_config import ROOT

# Skipped where vLLM cannot be imported (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
TP1 = ROOT / "configs" / "clusters" / "vllm_cpu_tp1.yaml"


def test_the_vllm_stall_bench_defaults_to_one_replica_tp2():
    run_cfg = run_config_for(None, "vllm")
    assert run_cfg.engine == "vllm" and run_cfg.cluster.name == "vllm_cpu.yaml"
    tp1 = run_config_for(None, "vllm", TP1)  # `wt bench stall --cluster`
    assert (tp1.engine, tp1.name, tp1.cluster) == ("vllm", run_cfg.name, TP1)


def test_both_modes_verified_on_vllm(tmp_path):
    out = tmp_path / "stall.json"
    rc = run(config=None, engine="vllm", updates=1, json_out=out, cluster=TP1)
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
