"""FP8 block geometry without tensors: block size, dtypes, scale shapes, block-aligned cuts.

Planning at 1T-parameter scale needs the shape of every ``weight_scale_inv`` and
whether a TP/EP cut splits a 128x128 block, but no arithmetic; this module has
no torch import so that ``scheduling`` stays pure. The arithmetic itself is in
:mod:`weight_transfer.layout.quant`.
"""

from __future__ import annotations

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"


def scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, ...]:
    """Shape of the ``scale_inv`` of a weight of ``shape`` (2-D or stacked 3-D)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block), -(-cols // block))


def block_cuts(
    rect: tuple[tuple[int, int], ...],
    full: tuple[int, ...],
    dst_rows: tuple[int, int],
    dst_extent: int,
    block: int = FP8_BLOCK,
) -> list[str]:
    """Why quantizing ``rect`` of a weight of shape ``full`` on its own, then placing it at
    rows ``dst_rows`` of a destination with ``dst_extent`` rows, would not give the
    blocks of quantizing each whole part (empty list: it does). Block edges must
    fall on multiples of ``block``, or on the end of the tensor (a partial last block)."""
    bad = [
        f"source {dim} [{a}, {b}) of {extent}"
        for dim, (a, b), extent in zip(("rows", "cols"), rect[-2:], full[-2:], strict=True)
        if a % block or (b % block and b != extent)
    ]
    r0, r1 = dst_rows
    if r0 % block or (r1 % block and r1 != dst_extent):
        bad.append(f"destination rows [{r0}, {r1}) of {dst_extent}")
    return bad
