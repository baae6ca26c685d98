"""Which elements of a flat-partitioned parameter each rank holds, from metadata alone (no torch).

DeepSpeed ZeRO-3 flattens every parameter and gives the rank at index ``i`` of its
partition group the elements ``[i * p, (i + 1) * p)`` of it, ``p = ceil(numel / n)``
(the last partition padded at the end: the padding is no element of the parameter).
The metadata says so with one placement, ``Placement(kind="flat")``, on a 1-D mesh of
the group's ranks in group order.

A rectangle of the parameter (a piece's source) meets a rank's range in one run of
the rectangle's own row-major order, so the rank writes that run as one contiguous
destination range. As rectangles the run is its whole rows and, where it starts or
ends inside a row, the partial rows at the edges (in N dims: the same, one dim down
at each edge)::

    flat_range(meta, rank)          # (start, stop) in elements, or None (not on the mesh)
    run_rects(rect, lo, hi)         # rectangles of positions [lo, hi) of rect's row-major order
    count_below(rect, shape, f)     # elements of rect whose flat index is < f
    holds_flat(meta, rank, rect)    # whether the rank's range holds every element of rect
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from weight_transfer.types import ParamMeta, Placement

Rect = tuple[tuple[int, int], ...]

FLAT = Placement(kind="flat")

__all__ = ["FLAT", "count_below", "flat_range", "flat_ranges", "holds_flat", "is_flat",
           "partition_numel", "rect_span", "run_rects"]


def is_flat(meta: ParamMeta) -> bool:
    """Whether ``meta`` is flat-partitioned: one ``Flat()`` placement on a 1-D mesh."""
    return meta.placements == (FLAT,) and len(meta.mesh.shape) == 1


def partition_numel(numel: int, n: int) -> int:
    """Elements of each rank's partition (ZeRO-3's ``ds_tensor.numel()``, padding included)."""
    return -(-numel // n)


def flat_ranges(numel: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the elements each of ``n`` partitions holds, in order."""
    p = partition_numel(numel, n)
    return [(min(i * p, numel), min((i + 1) * p, numel)) for i in range(n)]


def flat_range(meta: ParamMeta, rank: int) -> tuple[int, int] | None:
    """The elements trainer ``rank`` holds of a flat parameter, or None if it is not on
    the parameter's mesh."""
    try:
        i = meta.mesh.ranks.index(rank)
    except ValueError:
        return None
    return flat_ranges(math.prod(meta.shape), len(meta.mesh.ranks))[i]


def _strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def rect_span(shape: Sequence[int], rect: Rect) -> tuple[int, int]:
    """(flat index of the rectangle's first element, one past its last) in ``shape``."""
    st = _strides(shape)
    first = sum(a * s for (a, _), s in zip(rect, st, strict=True))
    last = sum((b - 1) * s for (_, b), s in zip(rect, st, strict=True))
    return first, last + 1


def count_below(rect: Rect, shape: Sequence[int], f: int) -> int:
    """How many elements of ``rect`` have a flat index below ``f`` in ``shape``."""
    ext = [b - a for a, b in rect]
    total = math.prod(ext)
    if f <= 0:
        return 0
    if f >= math.prod(shape):
        return total
    point, rest = [], f
    for s in _strides(shape):
        point.append(rest // s)
        rest %= s
    count = 0
    for d, ((a, b), x) in enumerate(zip(rect, point, strict=True)):
        count += min(max(x - a, 0), ext[d]) * math.prod(ext[d + 1:])
        if not a <= x < b:  # no element of rect shares this prefix with the point
            break
    return count


def run_rects(rect: Rect, lo: int, hi: int) -> list[Rect]:
    """Positions ``[lo, hi)`` of ``rect``'s row-major order as rectangles, in order: a
    partial row at each edge (recursively one dim down), whole rows between. Each has
    leading dims of extent 1, one cut dim and whole trailing dims of ``rect``, so its
    destination is one contiguous range of a piece with source ``rect``."""
    if lo >= hi:
        return []
    a, inner = rect[0][0], rect[1:]
    if not inner:
        return [((a + lo, a + hi),)]
    per_row = math.prod(y - x for x, y in inner)
    r0, r1 = lo // per_row, hi // per_row
    if r0 == r1:  # inside one row
        return [((a + r0, a + r0 + 1), *sub)
                for sub in run_rects(inner, lo - r0 * per_row, hi - r0 * per_row)]
    out: list[Rect] = []
    if lo % per_row:
        out += [((a + r0, a + r0 + 1), *sub) for sub in run_rects(inner, lo % per_row, per_row)]
        r0 += 1
    if r0 < r1:
        out.append(((a + r0, a + r1), *inner))
    if hi % per_row:
        out += [((a + r1, a + r1 + 1), *sub) for sub in run_rects(inner, 0, hi % per_row)]
    return out


def holds_flat(meta: ParamMeta, rank: int, rect: Rect) -> bool:
    """Whether every element of ``rect`` lies in the range trainer ``rank`` holds."""
    got = flat_range(meta, rank)
    if got is None:
        return False
    first, stop = rect_span(meta.shape, rect)
    return got[0] <= first and stop <= got[1]
