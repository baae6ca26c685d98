"""``wt bench stall`` end to end, one update per mode, on the demo's smallest shape (2 trainer
ranks -> 1 replica x TP1: a smoke run, the numbers belong to ``wt bench stall``).

Speed is never asserted (two shared cores): the bench's JSON has its shape, real numbers
and every update verified. (``wt chaos --apply shadow`` runs on test_faults.py's actors,
``test_wt_chaos_in_shadow_mode_tears_nothing_and_heals``: one fleet start fewer.)
"""

from __future__ import annotations

import json

import pytest

from actors.tools.bench.stall.bench import run as run_stall

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_bench_stall_json_has_both_modes_verified(tmp_path, ray_job, smallest_demo_run):
    out = tmp_path / "stall.json"
    rc = run_stall(config=smallest_demo_run, updates=1, json_out=out)
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
    # tiny_llama on one TP1 rank: a shadow of all its weights (4.17 MB in bf16)
    assert doc["modes"]["shadow"]["extra_engine_bytes"] > 4 * 1_000_000
