"""A rank of tests/integration/test_lora_sources.py: a PEFT LoRA model of a tiny Llama read
unsharded, under FSDP2 and under DeepSpeed ZeRO-3, in one gloo process group.

Run by ``multiprocessing`` spawn (the driver sets ``DS_ACCELERATOR=cpu`` and
``OMP_NUM_THREADS=1`` for the children). Every rank builds the same seeded PEFT model
(:func:`actors.tools.testkit.lora_oracle.peft_adapter`: random non-zero A and B) three
times: kept whole (the oracle), under ``fully_shard`` (each decoder layer and the root),
and under ``deepspeed.initialize`` at ZeRO-3 (which partitions it). Of each it reads
:func:`~weight_transfer.sources.lora.describe_peft` and
:func:`~weight_transfer.sources.lora.adapter_tensors`, takes one AdamW step on the same
tokens, and reads them again; a :class:`~weight_transfer.sources.lora.BaseWatch` built
after sharding is checked after the step and after a write into a base partition. What
comes back is plain data: specs, messages, and tensors as raw bytes.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from typing import Any

import torch
import torch.distributed as dist

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
# tiny_llama.yaml as transformers' config, in float32
LLAMA = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=128, intermediate_size=512, vocab_size=1000, tie_word_embeddings=False,
             rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=2048)
SEED, LR = 3, 1e-2
TAMPERED = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"


def make_peft() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.tools.testkit.lora_oracle import peft_adapter

    torch.manual_seed(0)
    return peft_adapter(LlamaForCausalLM(LlamaConfig(**LLAMA, dtype="float32")), seed=SEED)


def plain(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as picklable plain data (tensors sent through a pipe live in shared
    memory that vanishes when this process exits)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return str(t.dtype), tuple(t.shape), raw.numpy().tobytes()


def read(model: Any) -> dict[str, Any]:
    from weight_transfer.sources.lora import adapter_tensors, describe_peft

    return {"spec": describe_peft(model),
            "tensors": {n: plain(t) for n, t in adapter_tensors(model).items()}}


def tokens() -> torch.Tensor:
    return torch.randint(0, LLAMA["vocab_size"], (1, 16),
                         generator=torch.Generator().manual_seed(7))


def lora_params(model: Any) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if ".lora_" in n]


def watch_after(watch: Any, local_part: torch.Tensor) -> dict[str, Any]:
    """The watch after the adapter's step (the base untouched), then after a write into
    this rank's own part of one base weight."""
    out = {"after_step": watch.check()}
    with torch.no_grad():
        local_part.add_(1.0)
    try:
        watch.check()
        out["after_write"] = None
    except ValueError as exc:
        out["after_write"] = str(exc)
    return out


def unsharded() -> dict[str, Any]:
    model = make_peft()
    out = {"before": read(model)}
    opt = torch.optim.AdamW(lora_params(model), lr=LR)
    model(input_ids=tokens(), labels=tokens()).loss.backward()
    opt.step()
    out["after"] = read(model)
    return out


def fsdp2() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from weight_transfer.sources.lora import BaseWatch

    model = make_peft()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    watch = BaseWatch(model)
    out = {"sharded": all(p.to_local().numel() < p.numel() for p in lora_params(model)),
           "before": read(model)}
    opt = torch.optim.AdamW(lora_params(model), lr=LR)
    model(input_ids=tokens(), labels=tokens()).loss.backward()
    opt.step()
    out["after"] = read(model)
    out["watch"] = watch_after(watch, model.get_parameter(TAMPERED).to_local())
    return out


def zero3() -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from peft import get_peft_model_state_dict

    from weight_transfer.sources.lora import BaseWatch

    deepspeed.init_distributed("gloo")  # takes the process group already up
    model = make_peft()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=lora_params(model), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0,  # DeepSpeed's default: 1
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}})
    watch = BaseWatch(model)
    out = {"sharded": all(p.numel() == 0 and p.ds_tensor.numel() < p.ds_numel
                          for p in lora_params(model)),
           "before": read(model)}
    loss = engine(input_ids=tokens(), labels=tokens()).loss
    engine.backward(loss)
    engine.step()
    out["after"] = read(model)
    # DeepSpeed's own copy of the trained values: its optimizer's float32 partitions,
    # all-reduced (not GatheredParameters)
    master = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()
              if ".lora_" in n}
    out["master"] = {n: plain(t) for n, t in get_peft_model_state_dict(
        model, state_dict=master, adapter_name="default").items()}
    out["watch"] = watch_after(watch, model.get_parameter(TAMPERED).ds_tensor)
    return out


def run_rank(rank: int, world: int, port: int, conn: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        out = {"unsharded": unsharded(), "fsdp2": fsdp2()}
        if importlib.util.find_spec("deepspeed") is not None:
            out["zero3"] = zero3()
        conn.send(out)
    except BaseException as exc:
        conn.send(exc)
        raise
    finally:
        dist.destroy_process_group()
