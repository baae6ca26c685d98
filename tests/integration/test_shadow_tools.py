"""``wt bench stall`` and ``wt chaos --apply shadow`` end to end on the demo cluster (small).

Speed is never asserted (two shared cores): the bench's JSON has its shape, real numbers
and every update verified; the chaos run's faults (a stopped engine rank, a killed trainer
rank, short) each end as a transaction: no replica torn, every replica serving a complete
version it reports, a client on the spared replica never waiting longer than one flip,
and the next update heals.
"""

from __future__ import annotations

import json

import pytest

from actors.tools.bench.stall.bench import run as run_stall
from actors.tools.demo.chaos import run as run_chaos
from actors.tools.demo.run_config import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_bench_stall_json_has_both_modes_verified(tmp_path, ray_job):
    out = tmp_path / "stall.json"
    rc = run_stall(config=ROOT / "configs/runs/demo.yaml", updates=1, json_out=out)
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["verified"] is True, doc
    assert set(doc["modes"]) == {"in_place", "shadow"}
    for mode, row in doc["modes"].items():
        assert {"stall_s", "update_s", "extra_engine_bytes", "verified"} <= set(row)
        assert row["verified"] and len(row["stalls"]) == len(row["updates"]) == 1, mode
        assert 0 < row["stall_s"] < 60 and 0 < row["update_s"] < 60
        assert row["stall_s"] == max(row["stalls"]) and row["engine_pause_s"] > 0
        assert 0 < row["idle_stall_s"] < 60, row  # the noise floor: steps ran with no update
        assert row["added_stall_s"] == pytest.approx(max(0.0, row["stall_s"]
                                                         - row["idle_stall_s"]))
    assert doc["modes"]["in_place"]["extra_engine_bytes"] == 0
    # tiny_llama over 2 replicas x TP2: a shadow of every rank's weights (4 ranks)
    assert doc["modes"]["shadow"]["extra_engine_bytes"] > 4 * 1_000_000


def test_chaos_in_shadow_mode_tears_nothing_and_heals(tmp_path, ray_job):
    out = tmp_path / "chaos.json"
    rc = run_chaos(config=ROOT / "configs/runs/demo.yaml",
                   faults="engine-stopped-during,trainer-killed-during", update_timeout_s=15.0,
                   nic_gbps=0.01, json_path=out, apply="shadow")
    rows = json.loads(out.read_text())
    assert [r["fault"] for r in rows] == ["engine-stopped-during", "trainer-killed-during"]
    for r in rows:
        assert r["ok"] and r["healed"] and r["torn"] == [], r
        assert "longest wait" in r["outcome"] and "kept" in r["outcome"], r
    assert rc == 0
