"""A rank's flat partition of a parameter (ZeRO-3's ``param.ds_tensor``), as the sender reads it.

A :class:`FlatShard` is what a flat-partitioned parameter's ``get_param`` gives the
executor (:mod:`weight_transfer.sources.deepspeed` makes one per parameter and update):
the rank's partition, the parameter's full shape and where the partition starts in
the flattened parameter. The executor

* cuts a shard-direct piece's source from it with no copy (:func:`flat_view`: a
  strided view of the partition; the plan gave this rank only rectangles inside its
  range, :mod:`scheduling.build.direct_flat`);
* gathers a bucket of gathered parameters with one collective (:func:`gather_flat`:
  each partition padded to ``ceil(numel / n)`` elements and aligned, one
  ``all_gather`` over the partition group, each full tensor cut from the rank-major
  result), equal to DeepSpeed's own ``GatheredParameters`` bit for bit (only bytes move).

::

    shard = FlatShard(data=p.ds_tensor, shape=tuple(p.ds_shape), start=i * p.ds_tensor.numel(),
                      group=p.ds_process_group, world=n)
    view = flat_view(shard, ((0, 32), (0, 256)))   # rows 0..31, a view of ds_tensor
    fulls = gather_flat([shard, ...], names)        # every rank of the group calls
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from weight_transfer.layout.flat_blocks import partition_numel, rect_span

__all__ = ["FlatShard", "OverData", "flat_view", "gather_flat"]

_ALIGN = 16


class OverData:
    """What the pipeline asks of a source's block over a tensor ``data`` (the mixin of a
    frozen dataclass with a ``data`` field): its dtype, whether it is on a GPU, and the
    same block moved to a device (the h2d stage)."""

    __slots__ = ()
    data: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Any:
        """The same block over ``data`` moved to ``device``."""
        return replace(self, data=self.data.to(device, non_blocking=non_blocking))


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatShard(OverData):
    """One rank's range of a flattened parameter: ``data`` (1-D, at least ``valid``
    elements; ZeRO-3 pads the last partition), the full ``shape``, the element ``start``
    of the range, the partition ``group`` (a process group; None: the default one) and
    its size ``world``."""

    data: torch.Tensor
    shape: tuple[int, ...]
    start: int
    group: Any
    world: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def valid(self) -> int:
        """Elements of the parameter in the range (the rest of ``data`` is padding)."""
        return max(0, min(self.data.numel(), self.numel - self.start))


    def full_tensor(self) -> torch.Tensor:
        """The whole parameter: a collective over the partition group."""
        return gather_flat([self], ["<parameter>"])[0]


def flat_view(shard: FlatShard, rect: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The rectangle ``rect`` (global coordinates) of the parameter as a strided view of the
    rank's partition; ValueError if some element of it lies outside the rank's range."""
    first, stop = rect_span(shard.shape, rect)
    if first < shard.start or stop > shard.start + shard.valid:
        raise ValueError(f"rectangle {list(rect)} of a parameter of shape {shard.shape} spans "
                         f"flat elements [{first}, {stop}), the rank holds "
                         f"[{shard.start}, {shard.start + shard.valid})")
    data = shard.data
    if data.dim() != 1 or not data.is_contiguous():
        data = data.reshape(-1).contiguous()
    strides = [1] * len(shard.shape)
    for d in range(len(shard.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shard.shape[d + 1]
    return data.as_strided(tuple(b - a for a, b in rect), tuple(strides),
                           data.storage_offset() + first - shard.start)


def gather_flat(shards: Sequence[FlatShard], names: Sequence[str],
                record: Callable[[tuple], None] | None = None) -> list[torch.Tensor]:
    """The full tensors of ``shards`` (one partition group): one ``all_gather``."""
    group, world = shards[0].group, shards[0].world
    layout, total = [], 0  # (offset, padded bytes) per parameter
    for s, name in zip(shards, names, strict=True):
        if s.world != world or s.group is not group:
            raise ValueError(f"flat bucket of {names[0]!r}: parameter {name!r} is partitioned "
                             f"over another group ({s.world} ranks, bucket {world})")
        nbytes = partition_numel(s.numel, world) * s.data.element_size()
        layout.append((total, nbytes))
        total += -(-nbytes // _ALIGN) * _ALIGN
    device = shards[0].data.device
    inp = torch.zeros(total, dtype=torch.uint8, device=device)
    for s, (off, _) in zip(shards, layout, strict=True):
        n = s.valid * s.data.element_size()
        inp[off : off + n] = s.data[: s.valid].contiguous().view(torch.uint8)
    rows = all_gather_rows(inp, group, world, names, record)
    out = []
    for s, (off, nbytes) in zip(shards, layout, strict=True):
        flat = rows[:, off : off + nbytes].reshape(-1)[: s.numel * s.data.element_size()]
        out.append(flat.view(s.dtype).view(s.shape))
    return out

def all_gather_rows(inp: torch.Tensor, group: Any, world: int, names: Sequence[str],
                    record: Callable[[tuple], None] | None = None) -> torch.Tensor:
    """Every rank's ``inp`` (a flat uint8 buffer of one size on every rank of ``group``) as
    the rows of a ``(world, inp.numel())`` tensor: one ``all_gather``, recorded as
    ``("all_gather", names, bytes)``."""
    import torch.distributed as dist

    total = inp.numel()
    buf = torch.empty(world * total, dtype=torch.uint8, device=inp.device)
    if record is not None:
        record(("all_gather", tuple(names), total))
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(buf, inp, group=group)
    else:
        dist.all_gather(list(buf.view(world, total).unbind(0)), inp, group=group)
    return buf.view(world, total)
