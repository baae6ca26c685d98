"""Which block of a trainer parameter each rank holds, from metadata alone (no torch).

A DTensor chunks its tensor over the mesh dims in order (``torch.chunk`` along
each ``Shard(d)``'s tensor dim: ``ceil(n / m)`` rows per rank, the last ranks
fewer or none), and ``Replicate()`` dims copy the block. So every rank holds
one rectangle of the global tensor (its *block*, in global coordinates), and
the ranks that differ only on ``Replicate`` dims hold the same one. The
planner (:mod:`scheduling.build.direct`) asks which ranks hold a piece's source
rectangle; the executor asks where its own local tensor sits, to cut a piece
from it without a gather::

    local_rect(meta, rank)        # ((r0, r1), (0, cols)) or None (not on the mesh)
    owners_at(meta, point)        # the ranks whose block holds that element
    dim_cuts(meta)                # per tensor dim, where one block ends and another starts
    shifted(piece, rect)          # the piece with its source relative to ``rect``

A parameter whose placements are all ``Replicate()`` (or a plain tensor, which
the metadata describes so) is held whole by every rank of its mesh; one with a
``Partial()`` placement is held by no rank alone (:func:`ownership` says why). A
flat-partitioned one (ZeRO-3, ``Flat()``) holds no rectangle but a range of its
flattened elements (:mod:`weight_transfer.layout.flat_blocks`); :func:`holds` and
:func:`held` answer for every kind::

    holds(meta, rank, rect)       # whether the rank can cut rect from what it holds
    held(meta, rank)              # what it holds, in words (for error messages)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from weight_transfer.layout.flat_blocks import flat_range, holds_flat, is_flat
from weight_transfer.types import MeshDesc, ParamMeta, Piece, Placement

Rect = tuple[tuple[int, int], ...]

__all__ = ["Rect", "dim_cuts", "held", "holds", "local_rect", "mesh_coord", "owners_at",
           "ownership", "shifted"]


def ownership(meta: ParamMeta) -> str:
    """``"sharded"`` (Shard/Replicate, one Shard at least), ``"replicated"`` (every rank
    holds it whole), ``"flat"`` (ZeRO-3's flat partitions) or a sentence saying why no
    rank holds a block of its own."""
    pl = meta.placements
    if not pl or all(p.kind == "replicate" for p in pl):
        return "replicated"
    if is_flat(meta):
        return "flat"
    if len(pl) != len(meta.mesh.shape):
        return f"{len(pl)} placements for a mesh of {len(meta.mesh.shape)} dims"
    if any(p.kind == "flat" for p in pl):
        return "a Flat() placement is known only alone on a 1-D mesh"
    bad = [str(p) for p in pl if p.kind not in ("shard", "replicate")]
    if bad:
        return f"placement {bad[0]} leaves no rank a block of its own"
    if any(not 0 <= p.dim < len(meta.shape) for p in pl if p.kind == "shard"):
        return f"a placement shards a dim outside shape {meta.shape}"
    return "sharded"


def _levels(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]):
    return tuple((k, mesh_shape[k], p.dim) for k, p in enumerate(placements)
                 if p.kind == "shard")


def _chunk(lo: int, n: int, m: int, c: int) -> tuple[int, int]:
    """(start, length) of chunk ``c`` of ``[lo, lo + n)`` cut into ``m`` as torch.chunk."""
    size = -(-n // m)
    start = min(n, c * size)
    return lo + start, max(0, min(size, n - c * size))


def mesh_coord(mesh: MeshDesc, rank: int) -> tuple[int, ...] | None:
    """The rank's coordinate on the mesh (row-major over ``mesh.shape``), None if absent."""
    try:
        flat = mesh.ranks.index(rank)
    except ValueError:
        return None
    return tuple(int(x) for x in np.unravel_index(flat, mesh.shape))


def block_at(meta: ParamMeta, coord: Sequence[int]) -> Rect:
    """The block the rank at mesh coordinate ``coord`` holds (global coordinates)."""
    rect = [[0, n] for n in meta.shape]  # [start, length]
    for k, m, d in _levels(meta.placements, meta.mesh.shape):
        rect[d] = list(_chunk(rect[d][0], rect[d][1], m, coord[k]))
    return tuple((a, a + n) for a, n in rect)


def local_rect(meta: ParamMeta, rank: int) -> Rect | None:
    """The block trainer ``rank`` holds, or None if the rank is not on the parameter's mesh
    or holds no block of its own (:func:`ownership`)."""
    return _local_rect(meta.shape, meta.placements, meta.mesh, rank)


@functools.lru_cache(maxsize=1 << 14)
def _local_rect(shape, placements, mesh: MeshDesc, rank: int) -> Rect | None:
    meta = ParamMeta(name="", shape=shape, dtype="uint8", mesh=mesh, placements=placements)
    coord = mesh_coord(mesh, rank)
    kind = ownership(meta)
    if coord is None or kind not in ("sharded", "replicated"):
        return None
    if kind == "replicated":
        return tuple((0, n) for n in shape)
    return block_at(meta, coord)


@functools.lru_cache(maxsize=4096)
def _cuts(shape: tuple[int, ...], placements: tuple[Placement, ...],
          mesh_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    out = []
    levels = _levels(placements, mesh_shape)
    for d, n in enumerate(shape):
        spans = [(0, n)]
        for _, m, dd in levels:
            if dd == d:
                spans = [_chunk(a, ln, m, c) for a, ln in spans for c in range(m)]
        out.append(tuple(sorted({a for a, ln in spans if 0 < a < n and ln > 0})))
    return tuple(out)


def dim_cuts(meta: ParamMeta) -> tuple[tuple[int, ...], ...]:
    """Per tensor dim, the sorted interior coordinates where one rank's block ends and
    another's starts (empty for a replicated parameter)."""
    if ownership(meta) != "sharded":
        return tuple(() for _ in meta.shape)
    return _cuts(meta.shape, meta.placements, meta.mesh.shape)


def owners_at(meta: ParamMeta, point: Sequence[int]) -> tuple[int, ...]:
    """The ranks whose block holds the element at ``point`` (several on Replicate dims)."""
    if ownership(meta) == "replicated":
        return tuple(meta.mesh.ranks)
    coord = _coord_at(meta.shape, meta.placements, meta.mesh.shape, tuple(point))
    return _owners(meta.mesh, meta.placements, coord)


def _coord_at(shape, placements, mesh_shape, point) -> tuple[int, ...]:
    """Per sharded mesh dim (outermost first), the coordinate whose chunk holds ``point``."""
    rect = [[0, n] for n in shape]
    coord = []
    for _, m, d in _levels(placements, mesh_shape):
        size = -(-rect[d][1] // m)
        c = (point[d] - rect[d][0]) // size
        coord.append(c)
        rect[d] = list(_chunk(rect[d][0], rect[d][1], m, c))
    return tuple(coord)


@functools.lru_cache(maxsize=1 << 14)
def _owners(mesh: MeshDesc, placements: tuple[Placement, ...],
            coord: tuple[int, ...]) -> tuple[int, ...]:
    grid = np.asarray(mesh.ranks, dtype=np.int64).reshape(mesh.shape)
    index: list = [slice(None)] * len(mesh.shape)
    for (k, _, _), c in zip(_levels(placements, mesh.shape), coord, strict=True):
        index[k] = c
    return tuple(int(r) for r in np.asarray(grid[tuple(index)]).ravel())


@functools.lru_cache(maxsize=1 << 16)
def shifted(piece: Piece, rect: Rect) -> Piece:
    """``piece`` with its source rectangle relative to ``rect`` (a block that holds it).
    Cached: a static plan shifts the same pieces into the same blocks every update."""
    sl = tuple((a - r0, b - r0) for (a, b), (r0, _) in zip(piece.src_slice, rect, strict=True))
    if any(a < 0 or b > r1 - r0 for (a, b), (r0, r1) in zip(sl, rect, strict=True)):
        raise ValueError(f"piece {piece.src_param}{list(piece.src_slice)} -> {piece.dst_tensor}"
                         f"@{piece.dst_offset} is not inside the local block {list(rect)}")
    return dataclasses.replace(piece, src_slice=sl)


def holds(meta: ParamMeta, rank: int, rect: Rect) -> bool:
    """Whether trainer ``rank`` holds every element of ``rect`` (global coordinates)."""
    if ownership(meta) == "flat":
        return holds_flat(meta, rank, rect)
    block = local_rect(meta, rank)
    return block is not None and all(a0 <= a and b <= b0
                                     for (a, b), (a0, b0) in zip(rect, block, strict=True))


def held(meta: ParamMeta, rank: int) -> str:
    """What trainer ``rank`` holds of ``meta``, in words (for error messages)."""
    if ownership(meta) == "flat":
        got = flat_range(meta, rank)
        return "no range" if got is None else f"flat elements [{got[0]}, {got[1]})"
    block = local_rect(meta, rank)
    return "no block" if block is None else f"block {list(block)}"
