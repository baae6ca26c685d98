"""A PEFT LoRA adapter read from sharded trainers (issue 35, item 1): FSDP2 and DeepSpeed
ZeRO-3 on 2 gloo ranks on CPU.

Two spawned processes (``lora_sources_worker.py`` beside this file) hold one process group
and, one after the other, the same seeded PEFT model of a tiny Llama (tiny_llama's shape,
float32) three times: whole, under FSDP2 (``fully_shard`` per decoder layer and the root)
and under DeepSpeed ZeRO-3 (``deepspeed.initialize`` partitions the PEFT-wrapped model;
DeepSpeed's AdamW). Each rank holds part of every adapter tensor. On every rank:

1. before any step, :func:`describe_peft` (no collective) equals the unsharded model's,
   and :func:`adapter_tensors` (every rank calls: it gathers) equals the unsharded
   model's adapter tensors bit for bit;
2. after one AdamW step on the same tokens, FSDP2's adapter still equals the unsharded
   model's bit for bit. DeepSpeed's does to within a few float32 ulps (its ZeRO-3
   backward rounds differently from plain PyTorch): there the exact oracle is DeepSpeed's
   own copy of the trained values, its optimizer's float32 partitions
   (``safe_get_full_fp32_param``, an all-reduce, not ``GatheredParameters``);
3. a :class:`BaseWatch` built after sharding passes the adapter's step (the base is
   frozen; ZeRO-3 gathers and frees the base's data at every forward) and refuses, by
   name, a write into the rank's own part of a base weight.

What the tensors become in vLLM's slots is source-independent and runs in
tests/integration/test_vllm_lora.py; the refusals of odd ZeRO-3 parameters run in
tests/unit/test_lora_source_refusals.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from lora_sources_worker import ENV, TAMPERED, run_rank  # tests/integration is on sys.path

from actors.tools.testkit.source_fleet import spawned_ranks

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                       reason="the `lora` extra (peft) is not installed"),
]
WORLD = 2
NO_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                  reason="deepspeed is not installed (scripts/setup.sh "
                                         "installs it)")
ULPS_ATOL = 1e-6  # the ZeRO-3 step against the plain one: measured at most 2e-7


@pytest.fixture(scope="module")
def ranks():
    with spawned_ranks(run_rank, WORLD, env=ENV, what="LoRA source rank") as out:
        yield out


def tensor(raw) -> torch.Tensor:
    dtype, shape, data = raw
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype.removeprefix(
        "torch."))).reshape(shape)


def tensors(read) -> dict[str, torch.Tensor]:
    return {n: tensor(raw) for n, raw in read["tensors"].items()}


def unequal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return [n for n in want if not torch.equal(got[n], want[n])]


def check_before(rank: int, sharded: dict, oracle: dict) -> dict[str, torch.Tensor]:
    """Step 1 of the module docstring; the oracle's tensors before the step."""
    want = tensors(oracle["before"])
    assert len(want) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in want)
    assert sharded["sharded"], f"rank {rank} holds some adapter tensor whole: nothing gathered"
    assert sharded["before"]["spec"] == oracle["before"]["spec"], rank
    assert unequal(tensors(sharded["before"]), want) == [], rank
    return want


def check_watch(rank: int, watch: dict) -> None:
    assert watch["after_step"] is None, (rank, watch["after_step"])
    assert watch["after_write"] is not None and "base weights changed" in watch["after_write"]
    assert f"1 parameters: {TAMPERED}" in watch["after_write"], (rank, watch["after_write"])


def stepped(rank: int, got: dict, kind: str):
    """Steps 1 and 3 of the module docstring for ``kind``; (before, after, the oracle's
    tensors after the plain step, what ``kind`` sent)."""
    oracle, sharded = got["unsharded"], got[kind]
    before = check_before(rank, sharded, oracle)
    after = tensors(sharded["after"])
    assert unequal(after, before) == list(before), f"rank {rank}: no step taken"
    check_watch(rank, sharded["watch"])
    return before, after, tensors(oracle["after"]), sharded


def test_fsdp2_adapter_is_the_unsharded_one_on_every_rank(ranks):
    for rank, got in enumerate(ranks):
        _, after, plain_step, _ = stepped(rank, got, "fsdp2")
        assert unequal(after, plain_step) == [], rank


@NO_DEEPSPEED
def test_zero3_adapter_is_the_unsharded_one_on_every_rank(ranks):
    for rank, got in enumerate(ranks):
        before, after, plain_step, zero3 = stepped(rank, got, "zero3")
        assert unequal(after, {n: tensor(raw) for n, raw in zero3["master"].items()}) == [], rank
        for n in after:
            assert (after[n] - before[n]).abs().max() > 1000 * ULPS_ATOL, (rank, n)
            torch.testing.assert_close(after[n], plain_step[n], rtol=0, atol=ULPS_ATOL)


def test_every_rank_reads_the_same_adapter(ranks):
    kinds = [k for k in ("fsdp2", "zero3") if k in ranks[0]]
    for kind in kinds:
        for when in ("before", "after"):
            first = tensors(ranks[0][kind][when])
            assert all(unequal(tensors(r[kind][when]), first) == [] for r in ranks[1:]), kind
