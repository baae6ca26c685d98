"""Coalesced gathers on N-D meshes: one collective per sharded mesh dim for a whole bucket.

:mod:`weight_transfer.sender.gather` gathers FSDP2's 1-D ``(Shard(0),)`` buckets in
one ``all_gather``; this module gathers the other coalescible layouts
(:func:`weight_transfer.sender.buckets.coalescible`): every placement ``Shard(d)``
(any tensor dim) or ``Replicate()``, for example HSDP's ``(Replicate(),
Shard(0))`` on ``(dp_replicate, dp_shard)`` or EP x FSDP stacked experts'
``(Shard(0), Shard(1))`` on ``(ep, dp_shard_in_ep)``. All parameters of a
bucket share the mesh and the placements.

A DTensor shards the tensor over mesh dim 0 first (``torch.chunk`` along its
tensor dim: ``ceil(n / m)`` rows per rank, the last ranks fewer or none), then
each chunk over mesh dim 1, and so on; the rank's local tensor is the block at
the innermost level. :func:`gather_nd` undoes that innermost first: for each
sharded mesh dim ``k`` (``Replicate`` dims need nothing, every rank already
holds the same block), over ``mesh.get_group(k)``,

1. pack every parameter's block, padded to ``ceil(n / m_k)`` rows along its
   sharded dim (``n``: that dim of the block one level out, which every rank of
   the group shares) and aligned to 16 bytes, into one ``uint8`` input;
2. one ``all_gather`` (gloo: into views of one buffer; NCCL:
   ``all_gather_into_tensor``) of that input over the group;
3. cut each parameter's block one level out: the first ``shard_rows`` rows of
   every rank's padded block, concatenated along the sharded dim in rank order.

After the outermost sharded dim the blocks are the full tensors, equal to
``full_tensor()`` bit for bit (only bytes move). The peak memory of each level,
``(m_k + 1) * padded input + blocks one level out``, is what
:func:`weight_transfer.sender.buckets.reserve_bytes` counts::

    fulls = gather_nd(dtensors, metas, record=log.append)  # every rank of the mesh calls
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from weight_transfer.sender.buckets import _ALIGN, shard_rows
from weight_transfer.types import ParamMeta

__all__ = ["gather_nd", "level_shapes"]


def level_shapes(shape: tuple[int, ...], levels: Sequence[tuple[int, int, int]],
                 coord: Sequence[int]) -> list[tuple[int, ...]]:
    """The rank's block shape at each level: ``[global, after level 0, ..., local]``.

    ``levels``: ``(mesh dim, its size, tensor dim)`` per sharded mesh dim, outermost
    first; ``coord``: the rank's coordinate on the mesh.
    """
    out = [tuple(shape)]
    cur = list(shape)
    for k, m, d in levels:
        cur[d] = shard_rows(cur[d], m, coord[k])
        out.append(tuple(cur))
    return out


def gather_nd(dts: Sequence[Any], metas: Sequence[ParamMeta],
              record: Callable[[tuple], None] | None = None) -> list[torch.Tensor]:
    """The full tensors of DTensors ``dts`` (one mesh, one placement tuple); a collective
    on every rank of the mesh, one ``all_gather`` per sharded mesh dim, innermost first."""
    mesh, placements = dts[0].device_mesh, tuple(dts[0].placements)
    for d, m in zip(dts, metas, strict=True):
        if d.device_mesh != mesh or tuple(d.placements) != placements:
            raise ValueError(f"bucket of {metas[0].name!r}: parameter {m.name!r} is on "
                             f"{d.device_mesh} with {tuple(d.placements)}, the bucket on "
                             f"{mesh} with {placements}")
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"bucket of {metas[0].name!r}: this rank is not on its mesh {mesh}")
    levels = []
    for k, p in enumerate(placements):
        if p.is_shard():
            levels.append((k, mesh.size(k), p.dim))
        elif not p.is_replicate():
            raise ValueError(f"bucket of {metas[0].name!r}: placement {p} on mesh dim {k} "
                             f"cannot be gathered (only Shard and Replicate)")
    shapes = [level_shapes(tuple(d.shape), levels, coord) for d in dts]
    blocks = [d.to_local() for d in dts]
    for b, s, m in zip(blocks, shapes, metas, strict=True):
        if tuple(b.shape) != s[-1]:
            raise ValueError(f"rank {_global_rank()} at mesh coordinate {tuple(coord)}: "
                             f"parameter {m.name!r} holds a local shard of shape "
                             f"{tuple(b.shape)}, chunking {tuple(s[0])} as {placements} "
                             f"gives {s[-1]}")
    names = tuple(m.name for m in metas)
    for j in reversed(range(len(levels))):
        k, size, dim = levels[j]
        blocks = _gather_level(blocks, [s[j] for s in shapes], dim=dim,
                               group=mesh.get_group(k), world=size,
                               record=None if record is None else
                               (lambda n, k=k: record(("all_gather", names, n, k))))
    return blocks


def _gather_level(blocks: list[torch.Tensor], outer: list[tuple[int, ...]], *, dim: int,
                  group: Any, world: int,
                  record: Callable[[int], None] | None) -> list[torch.Tensor]:
    """One level: ``blocks`` (consumed) -> the blocks of shapes ``outer``, one all-gather."""
    import torch.distributed as dist

    layout = []  # (offset, padded shape, bytes) per parameter
    total = 0
    for b, shape in zip(blocks, outer, strict=True):
        padded = list(shape)
        padded[dim] = -(-shape[dim] // world)
        nbytes = _numel(padded) * b.element_size()
        layout.append((total, tuple(padded), nbytes))
        total += -(-nbytes // _ALIGN) * _ALIGN  # every dtype's view starts aligned
    dtypes = [b.dtype for b in blocks]
    inp = torch.zeros(total, dtype=torch.uint8, device=blocks[0].device)
    for b, (off, padded, nbytes) in zip(blocks, layout, strict=True):
        _as(inp[off : off + nbytes], b.dtype, padded).narrow(dim, 0, b.shape[dim]).copy_(b)
    blocks.clear()  # the previous level's blocks are in the input now: free them
    buf = torch.empty(world * total, dtype=torch.uint8, device=inp.device)
    if record is not None:
        record(total)
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(buf, inp, group=group)
    else:
        dist.all_gather(list(buf.view(world, total).unbind(0)), inp, group=group)
    rows = buf.view(world, total)
    out = []  # inp and buf live until the return, as reserve_bytes counts them
    for dtype, shape, (off, padded, nbytes) in zip(dtypes, outer, layout, strict=True):
        parts = [_as(rows[i, off : off + nbytes], dtype, padded)
                 .narrow(dim, 0, shard_rows(shape[dim], world, i)) for i in range(world)]
        out.append(torch.cat(parts, dim=dim))
    return out


def _as(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes ``raw`` (contiguous, aligned) seen as a tensor of ``dtype`` and ``shape``."""
    return raw.view(dtype).view(shape)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
