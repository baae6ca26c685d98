"""Shard-direct parts of a piece whose parameter is flat-partitioned (ZeRO-3, ``Flat()``).

Each rank holds one range of the flattened parameter
(:mod:`weight_transfer.layout.flat_blocks`). A piece's source rectangle meets that range
in one run of the rectangle's row-major order, so every rank's share of the piece
is one contiguous destination range, written from the rank's own partition:

* a TP=1 engine tensor or a dim-0 engine shard (whole rows of the parameter):
  the rank's whole rows as one part, and where its range starts or ends inside a
  row, that partial row as a part of its own;
* a row-parallel engine shard ``[rows, c0:c1]``: the rank's rows of it as one strided
  part, and the row its range cuts inside ``[c0, c1)`` as two parts at the edges (a
  cut outside ``[c0, c1)`` cuts nothing of the piece);
* FP8: only where every rank's range starts on a 128-row block boundary of the piece
  (whole rows of it), so each part quantizes exactly the blocks the piece would.

As in :mod:`scheduling.build.direct`, a piece cut into more than ``MAX_PARTS`` parts or
into parts averaging under ``min_part_bytes`` of source is gathered instead, and so
is, in turn, its parameter. Parts are ``(source rect, offset in the piece, bytes,
owners)`` with one owner each (ZeRO-3 keeps one copy of each element)::

    parts = cover_flat(src, transform, dst_dtype, shape, mesh, min_part_bytes)  # or why not
"""

from __future__ import annotations

import functools
import math

from weight_transfer.layout.engine_layout import part_bytes
from weight_transfer.layout.flat_blocks import count_below, flat_ranges, run_rects
from weight_transfer.layout.fp8_geometry import FP8_BLOCK
from weight_transfer.types import MeshDesc, Transform

__all__ = ["cover_flat"]


@functools.lru_cache(maxsize=1 << 16)
def cover_flat(src: tuple[tuple[int, int], ...], transform: Transform, dst_dtype: str,
               shape: tuple[int, ...], mesh: MeshDesc, min_part_bytes: int,
               max_parts: int = 1024):
    """Parts ``(rect, offset in the piece, bytes, owners)`` of source ``src``, or why not."""
    ext = tuple(b - a for a, b in src)
    total = math.prod(ext)
    runs = []  # (first position, last position + 1, owner) of each rank meeting src
    for rank, (f0, f1) in zip(mesh.ranks, flat_ranges(math.prod(shape), len(mesh.ranks)),
                              strict=True):
        lo, hi = count_below(src, shape, f0), count_below(src, shape, f1)
        if lo < hi:
            runs.append((lo, hi, rank))
    if transform != Transform.COPY:
        why = _fp8_cuts(ext, [lo for lo, _, _ in runs[1:]])
        if why:
            return f"FP8: {why} of source {list(src)}"
    parts = []
    for lo, hi, rank in runs:
        for rect in run_rects(src, lo, hi):
            off, n = part_bytes(src, rect, transform, dst_dtype)
            parts.append((rect, off, n, (rank,)))
    if len(parts) > max_parts:
        return f"flat partitions cut source {list(src)} into {len(parts)} parts (> {max_parts})"
    # measured in source bytes (bf16), as scheduling.build.direct does
    if len(parts) > 1 and total * 2 < min_part_bytes * len(parts):
        return (f"flat partitions cut source {list(src)} into {len(parts)} parts of "
                f"{total * 2 // len(parts)} source B on average (< {min_part_bytes} B)")
    return tuple(parts)


def _fp8_cuts(ext: tuple[int, ...], cuts: list[int]) -> str:
    """Why flat cuts at positions ``cuts`` of a source of extents ``ext`` break its FP8
    blocks ("" when every cut falls on a 128-row block boundary, or between experts)."""
    if len(ext) < 2:
        return "a 1-D source has no 128x128 blocks"
    row, plane = ext[-1], ext[-1] * ext[-2]
    for c in cuts:
        if c % row:
            return f"a flat partition boundary cuts a row at position {c}"
        if (c % plane) // row % FP8_BLOCK:
            return (f"a flat partition boundary at row {(c % plane) // row} cuts a "
                    f"{FP8_BLOCK}-row block")
    return ""

