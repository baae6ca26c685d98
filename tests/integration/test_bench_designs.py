"""``wt bench designs`` end to end on tiny_llama: every design runs once with NIC caps on, on
the demo's smallest shape (2 trainer ranks -> 1 replica x TP1: a smoke run, the numbers
belong to ``wt bench designs``), each verified byte for byte against the reference layout.

Speed is never asserted (two shared cores); only that each design verified, that
the JSON has its keys and that the numbers are real.
"""

from __future__ import annotations

import json
import math

import pytest

import actors.tools.bench.designs.bench as bench_designs
from actors.tools.bench.designs.bench import run
from actors.tools.demo.run_config import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_every_design_verified_on_tiny_llama(tmp_path, monkeypatch, ray_job,
        smallest_demo_run):  # shared Ray
    monkeypatch.setattr(bench_designs, "RDT_PROBE_TIMEOUT_S", 5.0)  # its outcome, not its wait
    out = tmp_path / "designs.json"
    rc = run(config=smallest_demo_run, model=ROOT / "configs/models/tiny_llama.yaml",
             nic_gbps=0.5, updates=1, designs="p2p,p2p_staged,rank0,rpc,bucketed,rdt",
             bucket="1M",
             caps_off=False, timeout_s=300.0, json_path=out, png=None)
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    assert {"results", "lower_bound_s", "passes", "memcpy_gbps", "bytes"} <= set(doc)
    assert set(doc["results"]) == {"p2p", "p2p_staged", "rank0", "rpc", "bucketed", "rdt"}
    details = doc["passes"]["caps_on"]["results"]
    for design in ("p2p", "p2p_staged", "rank0", "rpc", "bucketed"):
        assert details[design]["ok"], details[design]
        assert details[design]["problems"] == []
        assert math.isfinite(doc["results"][design]) and doc["results"][design] > 0
        assert details[design]["busiest_nic_bytes"] > 0
    # ours writes zero-copy where it may; p2p_staged copies every byte into staging first
    copied = doc["passes"]["caps_on"]["zero_copy"]["bytes_copied"]
    assert copied["p2p"] < copied["p2p_staged"] == doc["bytes"]
    assert details["p2p"]["sources"] == ["zero_copy"]
    assert details["p2p_staged"]["sources"] == ["snapshot"]
    assert doc["results"]["rdt"] is None  # a probe's outcome, never a time
    assert details["rdt"]["error"].startswith("not run as a design"), details["rdt"]
    assert 0 < doc["lower_bound_s"] < doc["results"]["p2p"]
    # which of ours binds is said from its own busy seconds
    b = doc["passes"]["caps_on"]["p2p_binding"]
    stages = details["p2p"]["stages_s"]
    assert (b["write_busy_s"], b["prepare_busy_s"]) == (stages["write"], stages["prepare"])
    assert b["binding"] == ("link" if stages["write"] >= stages["prepare"] else "cpu")
