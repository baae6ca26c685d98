"""The demo's checks: a flipped byte, a different token or far logits are caught and named."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from actors.tools.demo.checks import (
    UpdateCheck,
    byte_problems,
    expected_digests,
    logits_problems,
    logits_rel_error,
    render_table,
    tensor_digests,
    token_problems,
    write_json,
)
from actors.tools.demo.run_config import ROOT
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.models import load_model_config
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.types import ShardSpec

CFG = load_model_config(ROOT / "configs" / "models" / "tiny_llama.yaml")
SHARDS = {f"replica{r}/tp{t}": ShardSpec(tp_rank=t, tp_size=2) for r in (0, 1) for t in (0, 1)}


@pytest.fixture(scope="module")
def state():
    return random_state_dict(CFG, seed=5)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_engine_tensors_from_the_reference_loader_pass(state, fp8):
    want = expected_digests(CFG, state, SHARDS, fp8=fp8)
    got = {k: tensor_digests(load_engine_shard(CFG, state, s, fp8=fp8)) for k, s in SHARDS.items()}
    assert byte_problems(want, got) == []
    assert want["replica0/tp0"] != want["replica0/tp1"]  # shards differ, so the check can fail


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_one_flipped_byte_names_the_rank_and_tensor(state, fp8):
    want = expected_digests(CFG, state, SHARDS, fp8=fp8)
    tensors = load_engine_shard(CFG, state, SHARDS["replica1/tp0"], fp8=fp8)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    raw = as_bytes(tensors[name])
    raw[1234] ^= 0x01
    got = {k: (tensor_digests(tensors) if k == "replica1/tp0" else v) for k, v in want.items()}
    assert byte_problems(want, got) == [
        f"replica1/tp0: tensor {name} bytes differ from the reference layout"]


def test_bf16_and_fp8_layouts_are_not_interchangeable(state):
    bf16 = expected_digests(CFG, state, SHARDS, fp8=False)
    fp8 = expected_digests(CFG, state, SHARDS, fp8=True)
    problems = byte_problems(fp8, bf16)
    assert any("weight_scale_inv missing on the engine" in p for p in problems)
    assert any("qkv_proj.weight bytes differ" in p for p in problems)


def test_missing_and_extra_ranks_and_tensors_are_reported():
    want = {"r/tp0": {"a": "1", "b": "2"}, "r/tp1": {"a": "3"}}
    got = {"r/tp0": {"a": "1", "c": "9"}, "x/tp9": {}}
    assert byte_problems(want, got) == [
        "r/tp0: tensor b missing on the engine",
        "r/tp0: unexpected tensor c",
        "r/tp1: engine rank did not report its tensors",
        "x/tp9: engine rank not in the cluster layout",
    ]


def test_many_problems_are_capped_and_counted():
    want = {"r": {f"t{i:02d}": "x" for i in range(30)}}
    problems = byte_problems(want, {"r": {}})
    assert len(problems) == 21 and problems[-1] == "... and 10 more"


def test_token_problems_name_replica_prompt_and_position():
    want = [[1, 2, 3], [4, 5, 6]]
    assert token_problems(want, {"replica0": want, "replica1": [[1, 2, 3], [4, 5, 6]]}) == []
    assert token_problems(want, {"replica0": [[1, 2, 3], [4, 9, 6]], "replica1": [[1]]}) == [
        "replica0: prompt 1 differs at new token 1: trainer [4, 5, 6] engine [4, 9, 6]",
        "replica1: 1 generations for 2 prompts",
    ]


def test_logits_tolerance_is_relative_to_the_largest_trainer_logit():
    want = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    assert logits_rel_error(want, want + 0.2) == pytest.approx(0.05)
    worst, problems = logits_problems(want, {"replica0": want + 0.2, "replica1": want},
                                      rel_tol=0.1)
    assert (worst, problems) == (pytest.approx(0.05), [])
    worst, problems = logits_problems(want, {"replica0": want * 1.5}, rel_tol=0.1)
    assert worst == pytest.approx(0.5)
    assert problems == ["replica0: logits relative error 0.5000 > tolerance 0.1"]
    _, problems = logits_problems(want, {"replica0": want[:1]}, rel_tol=0.1)
    assert problems == ["replica0: logits shapes differ: trainer (2, 2), engine (1, 2)"]
    assert logits_rel_error(torch.zeros(2), torch.zeros(2)) == float("inf")


def _row(version, problems=()):
    return UpdateCheck(version=version, seconds=0.5, bytes=10_000_000,
                       stages={"h2d": 0.01, "prepare": 0.2, "write": 0.1, "barrier": 0.05},
                       checks={"bytes": not problems}, problems=list(problems))


def test_verified_needs_checks_and_no_problems():
    assert _row(1).verified
    assert not _row(2, ["replica0/tp0: tensor x bytes differ"]).verified
    assert not UpdateCheck(version=3, seconds=1.0, bytes=1, stages={}).verified  # nothing checked


def test_table_and_json_carry_every_number(tmp_path):
    rows = [_row(1), _row(2, ["replica0: prompt 0 differs at new token 3"])]
    console = Console(record=True, width=160)
    console.print(render_table(rows, title="t"))
    text = console.export_text()
    for cell in ("version", "GB/s", "h2d", "prepare", "write", "barrier", "0.020",
                 "10.00", "yes", "NO"):
        assert cell in text, cell
    doc = write_json(tmp_path / "sub" / "out.json", rows, model="tiny-llama", fp8=False)
    assert json.loads((tmp_path / "sub" / "out.json").read_text()) == doc
    assert doc["verified"] is False and doc["model"] == "tiny-llama"
    first, second = doc["updates"]
    assert first["verified"] is True and second["verified"] is False
    assert first["gb_per_s"] == pytest.approx(0.02)
    assert set(first["stages"]) == {"h2d", "prepare", "write", "barrier"}
    assert second["problems"] == ["replica0: prompt 0 differs at new token 3"]
    assert write_json(tmp_path / "e.json", [])["verified"] is False  # no update: not verified
