"""Which pieces a trainer rank can write straight from its own memory (no torch).

A piece is *zero-copy* on its source rank when its destination bytes already lie,
in order, in the memory that rank holds: a ``COPY`` piece whose destination dtype
is the parameter's own, of a shard-direct parameter (written from the rank's own
block, :mod:`weight_transfer.layout.shard_blocks`), whose source rectangle is one
contiguous run of that block (or of a flat ZeRO-3 range,
:mod:`weight_transfer.layout.flat_blocks`). Everything else (a strided cut, a
cast, FP8, a gathered parameter, a delta) goes through the staging arena.
The planner counts the bytes each way (``Plan.task_zero_copy``); the executor
marks the same pieces from the same function::

    contiguous_span(((2, 4), (0, 8)), (6, 8))   # (16, 32): rows 2-3 of a 6x8 block
    zero_copy_span(meta, piece, rank)           # element range in the rank's block, or None
"""

from __future__ import annotations

from collections.abc import Sequence

from weight_transfer.layout.flat_blocks import flat_range, is_flat, rect_span
from weight_transfer.layout.shard_blocks import local_rect
from weight_transfer.types import ParamMeta, Piece, Transform

Rect = tuple[tuple[int, int], ...]


def contiguous_span(rect: Rect, shape: Sequence[int]) -> tuple[int, int] | None:
    """(first, stop) flat element indexes of ``rect`` in a row-major tensor of ``shape``,
    or None when its elements are not one contiguous run there."""
    if len(rect) != len(shape):
        raise ValueError(f"rectangle {list(rect)} has {len(rect)} dimensions, the tensor "
                         f"{tuple(shape)} has {len(shape)}")
    ext = [b - a for a, b in rect]
    if any(e <= 0 for e in ext):
        return None
    # Contiguous: every dim after the innermost cut one is whole, every dim before it 1 wide.
    cuts = [d for d in range(len(shape)) if ext[d] != shape[d]]
    if cuts and any(ext[d] != 1 for d in range(cuts[-1])):
        return None
    return rect_span(shape, rect)


def zero_copy_span(meta: ParamMeta, piece: Piece, rank: int) -> tuple[int, int] | None:
    """The element range of ``piece``'s bytes in what ``rank`` holds of ``meta`` (its own
    block, or its flat range), or None when the piece needs a copy first (a transform,
    another dtype, a strided cut, or a source the rank does not hold)."""
    if piece.transform != Transform.COPY or piece.dst_dtype != meta.dtype:
        return None
    if piece.src_param != meta.name:
        raise ValueError(f"piece of {piece.src_param!r} checked against parameter "
                         f"{meta.name!r}")
    if is_flat(meta):
        held = flat_range(meta, rank)
        span = contiguous_span(piece.src_slice, meta.shape)
        if held is None or span is None or span[0] < held[0] or span[1] > held[1]:
            return None
        return span[0] - held[0], span[1] - held[0]
    block = local_rect(meta, rank)
    if block is None:
        return None
    if any(not (a0 <= a < b <= b0) for (a, b), (a0, b0) in zip(piece.src_slice, block,
                                                                 strict=True)):
        return None
    rel = tuple((a - a0, b - a0) for (a, b), (a0, _) in zip(piece.src_slice, block,
                                                             strict=True))
    return contiguous_span(rel, [b - a for a, b in block])
