"""Shard-direct pieces: which pieces one trainer rank can write from its own shard.

Today's mode (``gather="full"``) gathers every parameter on every rank of its
mesh (``full_tensor()`` or a coalesced all-gather) before any rank writes a
piece of it. With ``gather="shard_direct"`` the planner asks, per piece,
whether the block one rank already holds (:mod:`weight_transfer.layout.shard_blocks`)
covers the piece's source rectangle, cutting the piece where trainer blocks
meet, as long as every part stays one contiguous destination range:

* a piece inside one block (a column-parallel or fused-part slice of a dim-0
  FSDP shard, a norm, a replicated tensor) is one part;
* blocks that cut the piece along its first dim of extent > 1 give one part
  per block (a row-parallel engine slice ``[rows, c0:c1]`` of dim-0 shards:
  each part is one strided local copy and one contiguous write);
* blocks that cut a deeper dim (EP x FSDP stacked experts cut on rows) first
  split the leading dims into slices of extent 1 (one per expert), at most
  :data:`MAX_PARTS` parts;
* FP8: a cut must fall on a 128-row block boundary of the piece (or between
  experts), so each part quantizes exactly the blocks the whole piece would;
  never in the columns;
* a flat-partitioned parameter (ZeRO-3) is cut where the ranks' flat ranges meet:
  whole rows and partial rows at the edges (:mod:`scheduling.build.direct_flat`).

Each part's sources are the ranks that hold its block (one under FSDP; every
replica under HSDP). A *parameter* is shard-direct when all its pieces are
covered: its ranks then write from their shards with no collective. If one
piece is not covered, the parameter is gathered as today and all its pieces
come from the full tensor (the collective is per parameter; cutting some of its
pieces from the shard would save no collective and fix their sources). A parameter
whose cut would have each owner make many small writes (a part per engine rank that
holds it: a replicated router on every rank) is gathered too
(:data:`MAX_OWNER_WRITES`, checked per parameter in :mod:`scheduling.build.direct_assign`)::

    cov = cover_piece(piece, meta)   # Cover(parts=((piece, owners), ...), reason="")
    cov.direct                       # False: cov.reason says why (gathered instead)
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from scheduling.build.direct_flat import cover_flat
from weight_transfer.layout.engine_layout import part_bytes
from weight_transfer.layout.fp8_geometry import FP8_BLOCK
from weight_transfer.layout.shard_blocks import dim_cuts, owners_at, ownership
from weight_transfer.types import ParamMeta, Piece, Transform

GATHER_MODES = ("shard_direct", "full")
MAX_PARTS = 1024  # parts of one piece beyond which it is gathered instead (tiny writes)
# Below this mean size per part a cut piece is gathered instead: a write's fixed cost
# (~2 us on RDMA, 100 KB at 50 GB/s) beats a bucketed gather's share (norms over 256 ranks).
MIN_PART_BYTES = 16 << 10
# A write's fixed cost in bytes (~2 us on RDMA at 50 GB/s). Writes are made once per
# engine rank holding a part, a gather once per parameter: a parameter whose owners would
# each make more than MAX_OWNER_WRITES writes of it averaging under WRITE_COST_BYTES
# spend more on the writes' fixed costs than on its bytes, and is gathered instead.
# (Kimi-K2's router, 384 x 7168 over 256 FSDP ranks: 2-row blocks of 28 KB, each written
# to all 128 engine ranks, 128 writes per owner: 1.5 M tasks for 0.5% of the bytes.)
WRITE_COST_BYTES = 100 << 10
MAX_OWNER_WRITES = 64


@dataclass(frozen=True, slots=True)
class Cover:
    """How a piece is written: ``parts`` (sub-piece, its source ranks), or gathered
    (``parts`` empty) for ``reason``."""

    parts: tuple[tuple[Piece, tuple[int, ...]], ...]
    reason: str = ""

    @property
    def direct(self) -> bool:
        return bool(self.parts)


def check_gather_mode(mode: str) -> str:
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, not {mode!r}")
    return mode


def cover_piece(piece: Piece, meta: ParamMeta, *, min_part_bytes: int = MIN_PART_BYTES) -> Cover:
    """Whether (and in which parts) ranks' own blocks of ``meta`` cover ``piece``."""
    got = cover_parts(piece, meta, min_part_bytes=min_part_bytes)
    if isinstance(got, str):
        return Cover((), got)
    return Cover(cut_piece(piece, got))


def cover_parts(piece: Piece, meta: ParamMeta, *, min_part_bytes: int = MIN_PART_BYTES):
    """:func:`cover_piece` before any sub-piece is made: parts ``(source rect, offset in
    the piece, bytes, owners)``, or why not. Pieces with the same source rectangle,
    transform and parameter geometry get the same answer."""
    kind = ownership(meta)
    if kind == "replicated":
        return ((piece.src_slice, 0, piece.nbytes, tuple(meta.mesh.ranks)),)
    if kind == "flat":
        return cover_flat(piece.src_slice, piece.transform, piece.dst_dtype, meta.shape,
                          meta.mesh, min_part_bytes, MAX_PARTS)
    if kind != "sharded":
        return kind
    return _cover(piece.src_slice, piece.transform, piece.dst_dtype, meta.shape,
                  meta.placements, meta.mesh, min_part_bytes)


def cut_piece(piece: Piece, parts) -> tuple[tuple[Piece, tuple[int, ...]], ...]:
    """``(sub-piece, owners)`` of each part from :func:`cover_parts` (the piece itself
    when one part covers it all)."""
    if len(parts) == 1 and parts[0][0] == piece.src_slice:
        return ((piece, parts[0][3]),)
    return tuple(
        (Piece(dst_tensor=piece.dst_tensor, dst_offset=piece.dst_offset + off, nbytes=n,
               dst_dtype=piece.dst_dtype, src_param=piece.src_param, src_slice=rect,
               transform=piece.transform), owners)
        for rect, off, n, owners in parts)


@functools.lru_cache(maxsize=1 << 16)
def _cover(src, transform, dst_dtype, shape, placements, mesh, min_part_bytes):
    """Parts ``(rect, offset in the piece, bytes, owners)`` of a source rectangle, or why not."""
    meta = ParamMeta(name="", shape=shape, dtype="uint8", mesh=mesh, placements=placements)
    plan = _split_plan(src, transform, dim_cuts(meta))
    if isinstance(plan, str):
        return plan
    unit_dims, dim, segments = plan
    parts = []
    for pos in itertools.product(*(range(*src[d]) for d in unit_dims)):
        for a, b in segments:
            rect = list(src)
            for d, x in zip(unit_dims, pos, strict=True):
                rect[d] = (x, x + 1)
            if dim is not None:
                rect[dim] = (a, b)
            rect = tuple(rect)
            off, n = part_bytes(src, rect, transform, dst_dtype)
            parts.append((rect, off, n, owners_at(meta, [lo for lo, _ in rect])))
    # measured in source bytes (bf16): an FP8 scale part is tiny, its weight part is not
    total = math.prod(b - a for a, b in src) * 2
    if len(parts) > 1 and total < min_part_bytes * len(parts):
        return (f"trainer shards cut source {list(src)} into {len(parts)} parts of "
                f"{total // len(parts)} source B on average (< {min_part_bytes} B)")
    return tuple(parts)


@functools.lru_cache(maxsize=1 << 16)
def _split_plan(src: tuple[tuple[int, int], ...], transform: Transform,
                cuts: tuple[tuple[int, ...], ...]):
    """(dims cut into extent-1 slices, the cut dim or None, its segments), or a reason."""
    inside = [tuple(c for c in cs if a < c < b) for cs, (a, b) in zip(cuts, src, strict=True)]
    cut_dims = [d for d, cs in enumerate(inside) if cs]
    if not cut_dims:
        return (), None, ((0, 0),)
    dim = cut_dims[-1]
    ndim = len(src)
    fp8 = transform != Transform.COPY
    if fp8 and dim == ndim - 1:
        return f"FP8: trainer shards cut the columns of source {list(src)}"
    unit_dims = tuple(d for d in range(dim) if src[d][1] - src[d][0] > 1)
    if fp8 and ndim - 2 in unit_dims:
        return f"FP8: trainer shards cut source {list(src)} below whole 128-row blocks"
    a0, b0 = src[dim]
    if fp8 and dim == ndim - 2:
        bad = [c for c in inside[dim] if (c - a0) % FP8_BLOCK]
        if bad:
            return (f"FP8: a trainer shard boundary at row {bad[0]} cuts a {FP8_BLOCK}-row "
                    f"block of source rows [{a0}, {b0})")
    n = math.prod(src[d][1] - src[d][0] for d in unit_dims) * (len(inside[dim]) + 1)
    if n > MAX_PARTS:
        return f"trainer shards cut source {list(src)} into {n} parts (> {MAX_PARTS})"
    edges = (a0, *inside[dim], b0)
    return unit_dims, dim, tuple(itertools.pairwise(edges))

