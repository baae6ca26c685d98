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

The base weights the engine holds must be the ones the adapter is trained on. A
:class:`BaseWatch` notices when the trainer's base changed since the engine got it
(an optimizer step on unfrozen base weights, a merge) and refuses the adapter update,
naming the parameters, until the base is synced (a full-weight update, then
``watch.synced(version)``); ``lora_link.begin(base_version=watch.check())`` then also
refuses an engine that does not serve that base version.

Sharded trainers: :func:`describe_peft` reads global shapes with no collective (a DTensor's
own shape; a DeepSpeed ZeRO-3 parameter's ``ds_shape``). :func:`adapter_tensors` gathers:
with FSDP2 each DTensor's ``full_tensor()``, with ZeRO-3 the partitioned adapter
parameters in one ``deepspeed.zero.GatheredParameters`` (collectives: every trainer rank
calls it, in the same order); any rank then writes. ZeRO-1/2 and plain models hold their
adapters whole. Without ``peft`` installed, :meth:`AdapterSpec.of` builds the same
description from a plain state dict in PEFT's naming and a config dict.
"""

from __future__ import annotations

from typing import Any

import torch

from weight_transfer.engines.vllm.lora.spec import (
    AdapterSpec,
    LoraRankMeta,
    check_tensors,
    prepare_lora_piece,
    prepare_lora_piece_into,
)
from weight_transfer.sources.deepspeed import is_partitioned, swapped_out


def _peft_config(model: Any, adapter: str) -> dict[str, Any]:
    config = getattr(model, "peft_config", None)
    if not config or adapter not in config:
        raise ValueError(f"{type(model).__name__} has no PEFT adapter {adapter!r} (known: "
                         f"{sorted(config or ())}); wrap it with peft.get_peft_model")
    out = config[adapter].to_dict()
    if out.get("peft_type") not in (None, "LORA", "PeftType.LORA"):
        raise ValueError(f"adapter {adapter!r} is {out.get('peft_type')}, not LoRA")
    return out


def _adapter_parameters(model: Any, adapter: str) -> dict[str, Any]:
    """PEFT's own choice and naming of the adapter's tensors (``get_peft_model_state_dict``),
    over the parameters themselves (``keep_vars``), so that a ZeRO-3 parameter keeps its
    ``ds_shape`` and ``ds_tensor``."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=model.state_dict(keep_vars=True),
                                     adapter_name=adapter)


def _rank() -> str:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return f"trainer rank {dist.get_rank()}: "
    return ""


def _zero3_shape(name: str, t: Any) -> tuple[int, ...] | None:
    """The full shape of a DeepSpeed ZeRO-3 parameter (its own data is empty, its partition
    in ``ds_tensor``), None for any other tensor. ValueError for a ZeRO-3 parameter whose
    partitioning this module does not know: no partition, no full shape, or a partition
    swapped to NVMe (as :mod:`weight_transfer.sources.deepspeed` refuses it)."""
    if not hasattr(t, "ds_tensor"):
        return None
    part, shape = t.ds_tensor, getattr(t, "ds_shape", None)
    if part is None or shape is None:
        what = "no partition (ds_tensor is None)" if part is None else "no ds_shape"
        raise ValueError(f"{_rank()}adapter parameter {name!r} is partitioned by DeepSpeed "
                         f"(ds_tensor) but has {what}: not a ZeRO-3 parameter this source "
                         "knows")
    # swapped in for now, its home is still NVMe: refused as the swapped-out one is
    home = str(getattr(part, "final_location", "") or "").lower()
    if swapped_out(part) or home.endswith("nvme"):
        raise ValueError(f"{_rank()}adapter parameter {name!r} is a ZeRO-3 partition on NVMe "
                         "(offload_param.device nvme); the source reads partitions from "
                         "device or host memory only (offload_param: cpu)")
    return tuple(int(x) for x in shape)


def adapter_tensors(model: Any, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT's checkpoint naming, each a full plain tensor. Sharded
    ones are gathered, a collective every trainer rank calls: an FSDP2 DTensor with
    ``full_tensor()``, DeepSpeed ZeRO-3 partitions in one ``GatheredParameters`` (copied
    inside it: they are released again when it ends)."""
    _peft_config(model, adapter)
    params = _adapter_parameters(model, adapter)
    zero3 = [t for n, t in params.items() if _zero3_shape(n, t) is not None]
    if not zero3:
        return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
                for n, t in params.items()}
    import deepspeed  # only here: a ZeRO-3 parameter means DeepSpeed is installed

    gathered = {id(t) for t in zero3}
    with deepspeed.zero.GatheredParameters(zero3, modifier_rank=None):
        return {n: t.detach().clone() if id(t) in gathered else t.detach()
                for n, t in params.items()}


def describe_peft(model: Any, adapter: str = "default") -> AdapterSpec:
    """The adapter of a live PEFT model: its config and its parameters' global shapes (no
    collective, sharded or not)."""
    config = _peft_config(model, adapter)
    params = _adapter_parameters(model, adapter)
    shapes = {n: _zero3_shape(n, t) for n, t in params.items()}
    return AdapterSpec.of(config, {n: (tuple(t.shape) if shapes[n] is None else shapes[n],
                                       str(t.dtype).removeprefix("torch."))
                                   for n, t in params.items()})


def adapter_buffer(meta: LoraRankMeta) -> torch.Tensor:
    """Room for one version's bytes into ``meta``'s rank: allocate once, pass to every
    :func:`write_adapter` (the update then allocates nothing)."""
    return torch.empty(max(sum(p.nbytes for p in ps) for ps in meta.slot_pieces),
                       dtype=torch.uint8)


async def write_adapter(nic: Any, meta: LoraRankMeta, slot: int,
                        tensors: dict[str, torch.Tensor], *,
                        buffer: torch.Tensor | None = None) -> int:
    """Write one adapter version into ``slot`` of one engine rank through ``nic`` (connected
    to it); returns the bytes written. Every tensor is checked against the setup first:
    a mismatch is a ValueError and nothing is written. ``buffer``: from
    :func:`adapter_buffer`, reused (without it each piece is prepared into a new tensor)."""
    check_tensors(meta, tensors)
    pieces = meta.pieces(slot)
    if buffer is not None and buffer.numel() < sum(p.nbytes for p in pieces):
        raise ValueError(f"adapter {meta.name!r}: buffer of {buffer.numel()} B, one version "
                         f"needs {sum(p.nbytes for p in pieces)} (adapter_buffer(meta))")
    where = {t.name: t for t in meta.engine.tensors}
    total = 0
    for p in pieces:
        t = where[p.dst_tensor]
        full, scale = tensors[p.src_param], meta.scale(p.src_param)
        if buffer is None:
            data = prepare_lora_piece(full, p, scale)
        else:
            data = prepare_lora_piece_into(full, p, scale, buffer[total:total + p.nbytes])
        await nic.write(data, t.region, t.offset + p.dst_offset)
        total += p.nbytes
    return total


def _fingerprint(t: torch.Tensor) -> tuple[int, int, int]:
    """Storage address, autograd version counter and the sum of the raw words of the
    local tensor (a DTensor's shard, a ZeRO-3 parameter's partition: its own data comes
    and goes with every forward): any in-place step, ``.data`` write or swap of storage
    changes one of them. One read of the tensor, no copy."""
    if is_partitioned(t):
        local = t.ds_tensor
    else:
        local = t.to_local() if hasattr(t, "to_local") else t
    local = local.detach()
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
    total = int(local.contiguous().view(words).sum(dtype=torch.int64)) if local.numel() else 0
    return local.data_ptr(), local._version, total


def base_parameters(model: Any) -> dict[str, torch.Tensor]:
    """The PEFT model's parameters that are no adapter's (PEFT's ``lora_`` names aside)."""
    return {n: p for n, p in model.named_parameters() if ".lora_" not in n}


class BaseWatch:
    """Whether a PEFT model's base weights are still the ones the engine holds.

    Built when the engine holds the trainer's base (both loaded from one checkpoint, or
    right after a full-weight update: ``synced(version)``). :meth:`check` before each
    adapter update: a ValueError naming every base parameter changed since, or the base
    version the engine should serve (None before the first sync: the engine's own load).
    With FSDP2 or DeepSpeed ZeRO-3 each rank watches its own shards (partitions): build it
    once the model is sharded (``fully_shard``, ``deepspeed.initialize``), call it on every
    rank."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.version: str | None = None
        self._prints = self._now()

    def _now(self) -> dict[str, tuple[int, int, int]]:
        with torch.no_grad():
            return {n: _fingerprint(p) for n, p in base_parameters(self.model).items()}

    def synced(self, version: Any) -> None:
        """The base as it is now reached the engine as ``version`` (a full-weight update)."""
        self.version, self._prints = str(version), self._now()

    def check(self) -> str | None:
        """The base version the adapter update needs the engine to serve; ValueError
        naming the base parameters changed since the engine got the base."""
        now = self._now()
        changed = sorted(n for n in now.keys() | self._prints.keys()
                         if now.get(n) != self._prints.get(n))
        if changed:
            since = "loaded" if self.version is None else f"synced as version {self.version}"
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more"
                                              if len(changed) > 5 else "")
            raise ValueError(f"the trainer's base weights changed since the engine's copy was "
                             f"{since} ({len(changed)} parameters: {shown}): sync the base "
                             "(a full-weight update, then BaseWatch.synced) before the "
                             "adapter update")
        return self.version
