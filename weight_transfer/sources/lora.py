"""The trainer side of a LoRA adapter: describe it, read it, write it into vLLM's slots.

Only the adapter moves; the base weights are not touched. The names and the set of
tensors are PEFT's own (``get_peft_model_state_dict``: what ``save_pretrained`` writes,
``base_model.model.<module>.lora_A.weight``), so an adapter checkpoint on disk and an
adapter written from memory are the same thing to vLLM::

    spec = describe_peft(peft_model)               # AdapterSpec: config + parameter shapes
    metas = lora_link.setup(spec, nics=...)        # the engine records its slots (.lora)
    slot = lora_link.begin()
    nbytes = asyncio.run(write_adapter(nic, metas[0], slot, adapter_tensors(peft_model)))
    lora_link.flip(version=1)

With FSDP2 every parameter is a DTensor and :func:`adapter_tensors` gathers each one
(``full_tensor()``, a collective: every trainer rank calls it); any rank then writes.
Without ``peft`` installed, :meth:`AdapterSpec.of` builds the same description from a
plain state dict in PEFT's naming and a config dict.
"""

from __future__ import annotations

from typing import Any

import torch

from weight_transfer.engines.vllm.lora.spec import (
    AdapterSpec,
    LoraRankMeta,
    check_tensors,
    prepare_lora_piece,
)


def _peft_config(model: Any, adapter: str) -> dict[str, Any]:
    config = getattr(model, "peft_config", None)
    if not config or adapter not in config:
        raise ValueError(f"{type(model).__name__} has no PEFT adapter {adapter!r} (known: "
                         f"{sorted(config or ())}); wrap it with peft.get_peft_model")
    out = config[adapter].to_dict()
    if out.get("peft_type") not in (None, "LORA", "PeftType.LORA"):
        raise ValueError(f"adapter {adapter!r} is {out.get('peft_type')}, not LoRA")
    return out


def adapter_tensors(model: Any, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT's checkpoint naming, each a full plain tensor."""
    from peft import get_peft_model_state_dict

    _peft_config(model, adapter)
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
            for n, t in state.items()}


def describe_peft(model: Any, adapter: str = "default") -> AdapterSpec:
    """The adapter of a live PEFT model: its config and its parameters' global shapes."""
    from peft import get_peft_model_state_dict

    config = _peft_config(model, adapter)
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    return AdapterSpec.of(config, {n: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                   for n, t in state.items()})


async def write_adapter(nic: Any, meta: LoraRankMeta, slot: int,
                        tensors: dict[str, torch.Tensor]) -> int:
    """Write one adapter version into ``slot`` of one engine rank through ``nic`` (connected
    to it); returns the bytes written. Every tensor is checked against the setup first:
    a mismatch is a ValueError and nothing is written."""
    check_tensors(meta, tensors)
    where = {t.name: t for t in meta.engine.tensors}
    total = 0
    for p in meta.pieces(slot):
        t = where[p.dst_tensor]
        data = prepare_lora_piece(tensors[p.src_param], p, meta.scale(p.src_param))
        await nic.write(data, t.region, t.offset + p.dst_offset)
        total += p.nbytes
    return total
