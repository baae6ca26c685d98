"""``wt bench designs --engine vllm`` end to end on tiny_llama: 2 FSDP2 trainer ranks -> one
real vLLM replica x TP1 (the vLLM demo's fleet; ``configs/runs/bench_vllm_tp1.yaml``, the
smoke run of the bench's TP2 config: TP is not what the designs compare), every design
once with NIC caps on. Each
design's engine state is verified byte for byte against vLLM's own ``load_weights`` of the
trainers' weights, after every registered engine byte was zeroed before the update; the
baselines load with vLLM's ``load_weights`` inside its workers. One engine start.

Speed is never asserted (two shared cores); only that each design verified, that the JSON
has the reference bench's keys plus ``"engine": "vllm"`` and that the numbers are real.
"""

from __future__ import annotations

import json
import math

import pytest

from actors.tools.bench.designs.bench import run
from actors.tools.demo.run_config import ROOT

# Skipped where vLLM cannot be imported (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

DESIGNS = ("p2p", "rank0", "rpc", "bucketed")


def test_every_design_verified_against_vllm_on_tiny_llama(tmp_path):
    out = tmp_path / "designs.json"
    rc = run(engine="vllm", config=ROOT / "configs/runs/bench_vllm_tp1.yaml",
             model=ROOT / "configs/models/tiny_llama.yaml", nic_gbps=0.5, updates=1,
             designs=",".join(DESIGNS), bucket="1M", caps_off=False, timeout_s=300.0,
             json_path=out, png=None)
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
