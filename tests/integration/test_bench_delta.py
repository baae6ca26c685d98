"""``wt bench delta --quick`` end to end (tiny_llama, FP8 engines, one round of one lr on the
demo's smallest shape, 2 trainer ranks -> 1 replica x TP1: a smoke run, the numbers belong
to ``wt bench delta``): every
mode's update verified (the integrity check of every range and the reference-layout
byte check), the JSON ``runs`` as the issue names them, and deltas moving fewer bytes
than dense. Speed is never asserted (two shared cores)."""

from __future__ import annotations

import json

import pytest

from actors.tools.bench.delta import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
LR = 1e-5  # the larger of the bench's default lrs: more elements change


def test_quick_bench_runs_and_verifies_every_mode(tmp_path, ray_job,
        smallest_demo_run):  # shared Ray
    out = tmp_path / "delta.json"
    # A NIC slow enough that deltas pay by the time rule on tiny_llama: at 0.05 GB/s a rank's
    # 1.3 MB dense write (26 ms) is within the fixed cost of a delta update, and the rule's
    # choice (rightly either) turned on machine noise once in CI.
    rc = run(config=smallest_demo_run, model=None, nic_gbps=0.005, updates=1,
             lrs=str(LR), dtypes="fp8", quick=True, timeout_s=300.0, json_path=out)
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    modes = {r["mode"] for r in doc["runs"]}
    assert modes == {"gather", "shard_direct", "delta"}
    for r in doc["runs"]:
        assert {"dtype", "lr", "mode", "bytes", "seconds", "verified"} <= set(r)
        assert r["dtype"] == "fp8" and r["lr"] == LR and r["verified"] is True
        assert r["bytes"] > 0 and r["seconds"] > 0
    by = {r["mode"]: r for r in doc["runs"]}
    assert len(by) == len(doc["runs"])  # one row per mode
    assert by["delta"]["bytes"] < by["shard_direct"]["bytes"] / 5
    assert by["gather"]["bytes"] == pytest.approx(by["shard_direct"]["bytes"], rel=0.01)
    assert 0 < by["delta"]["changed_fraction"] < 0.5
    assert all(r["oracle"] for r in doc["rounds"])  # --oracle every (the default)
    # where the seconds went: per step of the controller, per trainer and engine rank, wall
    # and CPU; the time rule's estimate of the delta update holds its fixed cost
    for row in doc["rounds"]:
        acc = row["phases"]
        assert set(acc["controller"]) >= {"directive", "begin", "transfer", "apply", "check",
                                          "end"}
        assert all(v["wall"] >= 0 and v["cpu"] >= 0 for v in acc["controller"].values())
        assert len(acc["trainers"]) == 2 and {t["rank"] for t in acc["trainers"]} == {0, 1}
        assert all(t["run"]["cpu"] > 0 and t["prepare"]["cpu"] >= 0 for t in acc["trainers"])
    delta = next(r for r in doc["rounds"] if r["mode"] == "delta")
    assert delta["phases"]["engines"] and all(e["records"] > 0
                                              for e in delta["phases"]["engines"])
    assert delta["est_fixed_s"] is not None and delta["est_fixed_s"] > 0
    assert delta["est_delta_s"] > delta["est_fixed_s"]
    assert by["delta"]["phases"]["controller"]["transfer"]["wall"] > 0
