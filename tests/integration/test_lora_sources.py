"""A PEFT LoRA adapter read from sharded trainers (issue 35, item 1): FSDP2 and DeepSpeed
ZeRO-3 on 2 gloo ranks.

One pair of Ray actors (one process group) holds a PEFT model of a tiny Llama twice: under
FSDP2 (``fully_shard`` per decoder layer and the root) and under DeepSpeed ZeRO-3 (float32,
its AdamW). Each rank holds part of every adapter tensor. On every rank:

1. before any step, :func:`describe_peft` (no collective) equals the description of the
   same-seed unsharded PEFT model, and :func:`adapter_tensors` (every rank calls: it
   gathers) equals that model's adapter tensors bit for bit;
2. after a real optimizer step, :func:`adapter_tensors` equals the framework's own
   consolidation of the adapter (FSDP2: ``get_model_state_dict(full_state_dict=True)``;
   DeepSpeed: ``_zero3_consolidated_16bit_state_dict``, what its checkpoints save),
   and differs from the step before.

What the tensors become in vLLM's slots is source-independent and runs in
tests/integration/test_vllm_lora.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import ray
import torch

from actors.tools.testkit.source_fleet import free_port, kill, start_trainers

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                       reason="the `lora` extra (peft) is not installed"),
]

LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, vocab_size=128, tie_word_embeddings=False)
SEED, RANK = 3, 4
TOKENS = [[1, 5, 9, 100, 33, 7, 2, 2]]
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors take our class


def peft_model():
    """The same-seed PEFT model of a tiny Llama on every rank and in the driver."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.tools.testkit.lora_oracle import peft_adapter

    torch.manual_seed(0)
    return peft_adapter(LlamaForCausalLM(LlamaConfig(**LLAMA)), seed=SEED, r=RANK)


def read(model):
    from weight_transfer.sources.lora import adapter_tensors, describe_peft

    return describe_peft(model), adapter_tensors(model)


def adapter_of(model, state):
    """PEFT's adapter naming over a consolidated state dict."""
    from peft import get_peft_model_state_dict

    return {n: t.detach().clone() for n, t in
            get_peft_model_state_dict(model, state_dict=state, adapter_name="default").items()}


class LoraRank:
    def __init__(self, rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def _sharded(self, params) -> bool:
        """Every adapter parameter holds only part of its elements on this rank."""
        def local(p):
            if hasattr(p, "ds_tensor"):
                return p.ds_tensor.numel()
            return p.to_local().numel() if hasattr(p, "to_local") else p.numel()

        def full(p):
            return p.ds_numel if hasattr(p, "ds_tensor") else p.numel()

        return all(local(p) < full(p) for n, p in params if ".lora_" in n)

    def _step(self, model, opt_step) -> None:
        ids = torch.tensor(TOKENS)
        loss = model(input_ids=ids, labels=ids).loss
        opt_step(loss)

    def fsdp2(self):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = peft_model()
        mesh = init_device_mesh("cpu", (self.world,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = self._sharded(model.named_parameters())
        before = read(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

        def step(loss):
            loss.backward()
            opt.step()
            opt.zero_grad()

        self._step(model, step)
        after = read(model)[1]
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return sharded, before, after, adapter_of(model, full)

    def zero3(self):
        import deepspeed

        deepspeed.init_distributed("gloo")  # the group this actor made
        model = peft_model()
        engine, *_ = deepspeed.initialize(
            model=model, config=DS_CONFIG,
            model_parameters=[p for p in model.parameters() if p.requires_grad])
        module = engine.module
        sharded = self._sharded(module.named_parameters())
        before = read(module)

        def step(loss):
            engine.backward(loss)
            engine.step()

        self._step(engine, step)
        after = read(module)[1]
        consolidated = engine._zero3_consolidated_16bit_state_dict()  # rank 0 gets it
        return sharded, before, after, adapter_of(module, consolidated) if self.rank == 0 else None


@pytest.fixture(scope="module")
def ranks(ray_job):
    port = free_port()
    trainers = start_trainers(ray.remote(LoraRank), [(r, 2, port) for r in range(2)], env=ENV)
    try:
        yield trainers
    finally:
        kill(trainers)


@pytest.fixture(scope="module")
def reference():
    return read(peft_model())


def check(results, reference, consolidated_on_every_rank: bool):
    spec, tensors = reference
    assert tensors and all(".lora_A." in n or ".lora_B." in n for n in tensors)
    for rank, (sharded, (got_spec, got), after, consolidated) in enumerate(results):
        assert sharded, f"rank {rank} holds some adapter tensor whole: nothing was gathered"
        assert got_spec == spec, rank
        assert got.keys() == tensors.keys()
        assert all(torch.equal(got[n], tensors[n]) for n in tensors), rank
        assert after.keys() == tensors.keys()
        assert any(not torch.equal(after[n], tensors[n]) for n in tensors), "no step taken"
        if consolidated is not None:
            assert consolidated.keys() == after.keys()
            assert all(torch.equal(after[n], consolidated[n]) for n in after), rank
        else:
            assert not consolidated_on_every_rank
    # every rank read the same tensors
    assert all(torch.equal(results[0][2][n], r[2][n]) for r in results[1:] for n in tensors)


def test_fsdp2_adapter_is_described_and_gathered_on_every_rank(ranks, reference):
    check(ray.get([t.fsdp2.remote() for t in ranks]), reference, True)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (scripts/setup.sh installs it)")
def test_zero3_adapter_is_described_and_gathered_on_every_rank(ranks, reference):
    check(ray.get([t.zero3.remote() for t in ranks]), reference, False)
