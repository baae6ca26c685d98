"""The three ways a new LoRA adapter version reaches a vLLM engine, one update each.

A :class:`Rig` is one ``LLM`` (``enable_lora=True``, ``max_loras=3``: our adapter's two
slots and one for the disk path's) with our backend set up for full weights and a
trainer NIC connected to each TP rank. Per update, the trainer side holds a PEFT model:

* ``ours``: the adapter's tensors (PEFT's state dict) prepared into buffers allocated
  once and written one-sided into the free slot, then the flip at a step boundary
  (:class:`~weight_transfer.engines.vllm.lora.link.LoraLink`);
* ``disk``: ``save_pretrained`` then vLLM's own load of that checkpoint under one id
  (``LLMEngine.add_lora`` with ``load_inplace``: what ``/v1/load_lora_adapter`` runs);
* ``merged``: PEFT's own delta (``get_delta_weight``) added to the base, then a
  full-weight update of the merged model (pause, every engine byte written, resume).

Verified: ``ours`` and ``disk`` of one version leave equal bytes in every slot tensor of
every TP rank (vLLM's own load is the oracle of ours); ``merged``: every registered byte
equals vLLM's ``load_weights`` of the merged checkpoint.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SERVED_ID, DISK_ID = 1, 2


@dataclass
class Rig:
    """One engine with our backend set up, its trainer NICs, and where files go."""

    llm: Any
    link: Any
    metas: list[Any]  # full-weight EngineRankMeta per TP rank
    nics: list[Any]  # the trainer's NIC connected to each TP rank
    root: Path
    model_cfg: Any  # the ModelConfig the engine's checkpoint was built from
    dtype: torch.dtype
    lora: Any = None  # the LoraLink of the adapter under test
    lmetas: list[Any] = field(default_factory=list)
    buffers: list[Any] = field(default_factory=list)  # per rank, ours' prepare buffer
    version: int = 0

    @property
    def tp(self) -> int:
        return len(self.metas)


def connect(link: Any, meta: Any, spec: Any, rank: int) -> Any:
    """A trainer NIC connected both ways to TP rank ``rank`` of ``link``."""
    from actors.tools.testkit.vllm_oracle import connect_nic

    return connect_nic(meta, spec, trainer=f"trainer{rank}", nic=f"tnode0/nic{rank}",
                       endpoints=lambda reqs: link.call("endpoints", reqs, rank=rank)[0],
                       connect=lambda conns: link.call("connect", conns, rank=rank)[0])


def start_rig(model_yaml: Path, *, tp: int, max_rank: int, root: Path,
              dtype: torch.dtype = torch.bfloat16) -> Rig:
    """A fresh engine of a random checkpoint of ``model_yaml``, set up and connected."""
    from actors.tools.testkit.vllm_oracle import save_checkpoint, start_llm
    from weight_transfer.engines.vllm.driver import VllmLink
    from weight_transfer.engines.vllm.mailbox import SetupRequest
    from weight_transfer.model.models import load_model_config
    from weight_transfer.transport.options import DEFAULT_TRANSPORT

    _, path = save_checkpoint(model_yaml, seed=11, root=root, dtype=dtype)
    llm = start_llm(path, tp=tp, dtype=str(dtype).removeprefix("torch."), enable_lora=True,
                    max_loras=3, max_lora_rank=max_rank)
    return attach_rig(llm, model_cfg=load_model_config(model_yaml), root=root, dtype=dtype,
                      link=VllmLink(llm), setup=SetupRequest(
                          replica="engine0", nics=tuple((f"inode0/nic{r}",) for r in range(tp)),
                          transport=DEFAULT_TRANSPORT))


def attach_rig(llm: Any, *, model_cfg: Any, root: Path, dtype: torch.dtype, link: Any,
               setup: Any = None, metas: list[Any] | None = None,
               nics: list[Any] | None = None) -> Rig:
    """A rig over an engine: set up here (``setup``) or already (``metas`` and ``nics``)."""
    from weight_transfer.transport.options import DEFAULT_TRANSPORT

    if metas is None:
        metas = link.setup(setup)
        nics = [connect(link, m, DEFAULT_TRANSPORT, r) for r, m in enumerate(metas)]
    return Rig(llm=llm, link=link, metas=list(metas), nics=list(nics), root=root,
               model_cfg=model_cfg, dtype=dtype)


def adapter_model(rig: Rig, rank: int, *, seed: int) -> Any:
    """A PEFT model (rank ``rank``, alpha 2r, every projection) over a base of the engine's
    architecture, with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    from weight_transfer.engines.reference.hf_model import build_hf_model

    cfg = rig.model_cfg.model_copy(update={"torch_dtype": str(rig.dtype).removeprefix("torch.")})
    base = build_hf_model(cfg, seed=seed, dtype=rig.dtype)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                            init_lora_weights=False))
    train_step(model, seed=seed)
    return model


def train_step(model: Any, *, seed: int) -> None:
    """New adapter values, same shapes (what an optimizer step does)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)


def setup_ours(rig: Rig, model: Any) -> None:
    """Our adapter's two slots in every rank (once per adapter shape)."""
    from weight_transfer.engines.vllm.lora.link import LoraLink
    from weight_transfer.sources.lora import adapter_buffer, describe_peft

    if rig.lora is not None:
        rig.lora.close()
    rig.lora = LoraLink(rig.link, name="bench", lora_int_id=SERVED_ID)
    rig.lmetas = rig.lora.setup(describe_peft(model),
                                nics=tuple((m.tensors[0].region.nic,) for m in rig.metas))
    rig.buffers = [adapter_buffer(m) for m in rig.lmetas]  # once; every update reuses them


def ours(rig: Rig, model: Any) -> int:
    """One version written one-sided into the free slot of every rank, then the flip."""
    from weight_transfer.sources.lora import adapter_tensors, write_adapter

    rig.version += 1
    tensors = adapter_tensors(model)
    slot = rig.lora.begin()

    async def every_rank() -> list[int]:
        return await asyncio.gather(*(
            write_adapter(nic, meta, slot, tensors, buffer=buf)
            for nic, meta, buf in zip(rig.nics, rig.lmetas, rig.buffers, strict=True)))

    written = sum(asyncio.run(every_rank()))
    rig.lora.flip(version=rig.version)
    return written


def disk(rig: Rig, model: Any) -> int:
    """``save_pretrained`` and vLLM's own load of it (in place under one id); the bytes of
    the checkpoint written and read."""
    from vllm.lora.request import LoRARequest

    path = rig.root / "disk-adapter"
    model.save_pretrained(path)
    with rig.link._send:  # vLLM's client socket: one sender at a time
        rig.llm.llm_engine.add_lora(LoRARequest("disk", DISK_ID, str(path), load_inplace=True))
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The base with the adapter merged, in Hugging Face names (PEFT's own delta)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    with torch.no_grad():
        for name, module in model.get_base_model().named_modules():
            if isinstance(module, LoraLayer):
                w = module.get_base_layer().weight
                out[f"{name}.weight"] = w + module.get_delta_weight("default").to(w.dtype)
        for name, p in model.get_base_model().named_parameters():
            if ".lora_" not in name and ".base_layer." not in name:
                out[name] = p.detach()
    return out


def merged(rig: Rig, model: Any) -> int:
    """The merged model as a full-weight update (the engine paused throughout)."""
    from actors.tools.testkit.vllm_oracle import write_update

    rig.version += 1
    state = merged_state(model)
    rig.link.pause()
    try:
        written = sum(write_update(nic, meta, state)
                      for nic, meta in zip(rig.nics, rig.metas, strict=True))
    finally:
        rig.link.resume(version=rig.version)
    return written


DESIGNS = {"ours": ours, "disk": disk, "merged": merged}


# ------------------------------------------------------------------ oracles


def slots_equal(rig: Rig) -> bool:
    """Whether our served slot and vLLM's own load of the same version agree byte for
    byte in every slot tensor of every rank."""
    from actors.tools.testkit.lora_oracle import slot_differences

    return all(not d for d in rig.llm.collective_rpc(slot_differences,
                                                     args=(SERVED_ID, DISK_ID)))


def merged_equal(rig: Rig, model: Any) -> bool:
    """Every registered byte of every rank equals vLLM's load_weights of the merged
    checkpoint."""
    from safetensors.torch import save_file

    from actors.tools.testkit.vllm_oracle import oracle_check

    path = rig.root / "merged"
    path.mkdir(exist_ok=True)
    save_file({n: t.contiguous() for n, t in merged_state(model).items()},
              str(path / "model.safetensors"))
    return all(not problems for problems, _ in rig.llm.collective_rpc(oracle_check,
                                                                     args=(str(path),)))
