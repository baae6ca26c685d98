"""Turn one trainer parameter into the exact destination bytes of one piece.

``full`` is the whole trainer parameter in its global shape (for an FSDP2
``DTensor``: ``param.full_tensor()``), on any device. :func:`prepare_piece`
cuts the piece's ``src_slice`` rectangle out of it and applies the piece's
transform::

    COPY        cast to the destination dtype (no copy when dtype and layout agree)
    FP8_WEIGHT  128x128 block-quantize the rectangle, the float8_e4m3fn values
    FP8_SCALE   the same quantization, its float32 scale_inv

The result is contiguous and exactly ``piece.nbytes`` long; :func:`piece_bytes`
gives it as a flat uint8 view for the transports. :func:`prepare_pieces`
quantizes a rectangle once when its weight and scale pieces are both asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weight_transfer.quant import quantize_fp8_blocks
from weight_transfer.types import Piece, Transform


def _dtype(name: str, piece: Piece) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"piece {_describe(piece)}: unknown destination dtype {name!r}")
    return dtype


def _describe(piece: Piece) -> str:
    return (
        f"{piece.src_param}{list(piece.src_slice)} -> {piece.dst_tensor}"
        f"@{piece.dst_offset} ({piece.transform}, {piece.nbytes} B)"
    )


def source_rect(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's rectangle of ``full`` (a view); ValueError naming the piece on mismatch."""
    if full.dim() != len(piece.src_slice):
        raise ValueError(
            f"piece {_describe(piece)}: source has shape {tuple(full.shape)}, "
            f"the piece expects {len(piece.src_slice)} dimensions"
        )
    for dim, (a, b) in enumerate(piece.src_slice):
        if not 0 <= a < b <= full.shape[dim]:
            raise ValueError(
                f"piece {_describe(piece)}: slice [{a}, {b}) of dim {dim} lies outside "
                f"source shape {tuple(full.shape)}"
            )
    return full[tuple(slice(a, b) for a, b in piece.src_slice)]


def _finish(out: torch.Tensor, piece: Piece) -> torch.Tensor:
    if out.dtype != _dtype(piece.dst_dtype, piece):
        raise ValueError(
            f"piece {_describe(piece)}: transform gives {out.dtype}, the piece expects "
            f"{piece.dst_dtype}"
        )
    out = out.contiguous()
    nbytes = out.numel() * out.element_size()
    if nbytes != piece.nbytes:
        raise ValueError(f"piece {_describe(piece)}: prepared {nbytes} B, expected {piece.nbytes}")
    return out


def prepare_piece(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The destination bytes of ``piece`` as a contiguous tensor of ``piece.dst_dtype``."""
    rect = source_rect(full, piece)
    if piece.transform == Transform.COPY:
        return _finish(rect.to(_dtype(piece.dst_dtype, piece)), piece)
    if piece.transform not in (Transform.FP8_WEIGHT, Transform.FP8_SCALE):
        raise ValueError(f"piece {_describe(piece)}: unknown transform {piece.transform!r}")
    if rect.dim() not in (2, 3):
        raise ValueError(f"piece {_describe(piece)}: FP8 needs a 2-D or 3-D source rectangle")
    w8, scale = quantize_fp8_blocks(rect)
    return _finish(w8 if piece.transform == Transform.FP8_WEIGHT else scale, piece)


def prepare_pieces(full: torch.Tensor, pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """:func:`prepare_piece` for several pieces of one parameter, quantizing each
    distinct rectangle once (an FP8 weight piece and its scale piece share it)."""
    cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for piece in pieces:
        if piece.transform == Transform.COPY:
            out.append(prepare_piece(full, piece))
            continue
        if piece.src_slice not in cache:
            rect = source_rect(full, piece)
            if rect.dim() not in (2, 3):
                raise ValueError(f"piece {_describe(piece)}: FP8 needs a 2-D or 3-D rectangle")
            cache[piece.src_slice] = quantize_fp8_blocks(rect)
        w8, scale = cache[piece.src_slice]
        out.append(_finish(w8 if piece.transform == Transform.FP8_WEIGHT else scale, piece))
    return out


def piece_bytes(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """:func:`prepare_piece` as a flat, contiguous uint8 tensor (for transports)."""
    return as_bytes(prepare_piece(full, piece))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.contiguous().reshape(-1).view(torch.uint8)
