"""One contiguous, registrable memory buffer holding every tensor of an engine rank.

An inference rank registers its weights with a NIC once; a weight update then
writes straight into them while the engine runs no code. So all tensors of the
rank live in ONE buffer from :func:`weight_transfer.sender.host_memory.alloc_buffer`
(private, 2 MiB-aligned, huge-page advised, pre-faulted: a remote write hits no
page fault), each a typed view at a 128-byte-aligned offset::

    buf = EngineBuffer(engine_tensor_specs(cfg, shard, fp8=False))
    buf.tensors["model.norm.weight"]        # bfloat16 view into buf.buffer
    buf.offsets["model.norm.weight"]        # its byte offset in the buffer
    nic.register(buf.buffer)                # one region for the whole rank
    buf.specs()                             # [(name, shape, dtype, offset), ...]

The layout is a pure function of the spec list (:func:`slot_layout`), so the
offsets a planner assumes can be computed without allocating anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_transfer.sender.host_memory import alloc_buffer
from weight_transfer.types import TensorSpec

TENSOR_ALIGN = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSlot(TensorSpec):
    """Where one engine tensor lives in the rank's buffer: its spec and byte offset."""

    offset: int


def slot_layout(
    specs: Sequence[TensorSpec], align: int = TENSOR_ALIGN
) -> tuple[list[TensorSlot], int]:
    """Slots in spec order, each at the next multiple of ``align``; and the total size."""
    slots, offset, seen = [], 0, set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"engine tensor {spec.name} is listed twice")
        seen.add(spec.name)
        offset = -(-offset // align) * align
        slots.append(
            TensorSlot(name=spec.name, shape=tuple(spec.shape), dtype=spec.dtype, offset=offset)
        )
        offset += spec.nbytes
    return slots, max(offset, 1)


class EngineBuffer:
    """The tensors of one engine rank as typed views into one pre-faulted uint8 buffer."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.slots, self.nbytes = slot_layout(specs)
        self._mapping, start, self.addr = alloc_buffer(self.nbytes)
        raw = memoryview(self._mapping)[start : start + self.nbytes]
        self.buffer = torch.frombuffer(raw, dtype=torch.uint8)
        assert self.buffer.data_ptr() == self.addr
        self.tensors: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, int] = {}
        for s in self.slots:
            view = self.buffer[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype))
            self.tensors[s.name] = view.view(s.shape)
            self.offsets[s.name] = s.offset

    def specs(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        """``(name, shape, dtype, offset)`` of every tensor, in buffer order."""
        return [(s.name, s.shape, s.dtype, s.offset) for s in self.slots]

    def fill(self, values: dict[str, torch.Tensor]) -> None:
        """Copy ``values`` (exactly the buffer's tensors, same shapes and dtypes) in."""
        missing = sorted(set(self.tensors) - set(values))
        extra = sorted(set(values) - set(self.tensors))
        if missing or extra:
            raise ValueError(f"engine state: missing tensors {missing}, unexpected {extra}")
        for name, view in self.tensors.items():
            value = values[name]
            if tuple(value.shape) != tuple(view.shape) or value.dtype != view.dtype:
                raise ValueError(
                    f"engine tensor {name}: got {tuple(value.shape)} {value.dtype}, "
                    f"expected {tuple(view.shape)} {view.dtype}"
                )
            view.copy_(value)

    def state_bytes(self) -> dict[str, torch.Tensor]:
        """A uint8 copy of every tensor's bytes."""
        return {
            s.name: self.buffer[s.offset : s.offset + s.nbytes].clone() for s in self.slots
        }
