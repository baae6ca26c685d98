"""Turn one trainer parameter into the exact destination bytes of one piece.

``full`` is the whole trainer parameter in its global shape (for an FSDP2
``DTensor``: ``param.full_tensor()``), on any device. :func:`prepare_piece`
cuts the piece's ``src_slice`` rectangle out of it and applies the piece's
transform::

    COPY        cast to the destination dtype (no copy when dtype and layout agree)
    FP8_WEIGHT  128x128 block-quantize the rectangle, the float8_e4m3fn values
    FP8_SCALE   the same quantization, its float32 scale_inv
    PAD_COLS    COPY, then zeros on the right of every row up to the piece's width

The result is contiguous and exactly ``piece.nbytes`` long; :func:`piece_bytes`
gives it as a flat uint8 view for the transports. :func:`prepare_pieces`
quantizes a rectangle once when its weight and scale pieces are both asked for.

:func:`prepare_pieces_into` writes the same bytes into buffers the caller
owns (slices of a registered staging arena, :mod:`weight_transfer.sender.staging`):
a COPY piece is cut and cast straight into its buffer with no intermediate
tensor (on any device: the copy crosses to the buffer's device too); an FP8
piece is quantized once per rectangle, then copied in. With ``views=True`` a
COPY piece that already is a contiguous slice of ``full`` in its dtype is not
copied at all: its bytes are a view of ``full`` (for transports that write
from any host memory)::

    outs = [arena_lease.buf[o : o + p.nbytes] for o, p in zip(offsets, pieces)]
    sources = prepare_pieces_into(full, pieces, outs)   # flat uint8, one per piece
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weight_transfer.layout.quant import quantize_fp8_blocks
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
    if piece.transform == Transform.PAD_COLS:
        out = torch.empty(piece.nbytes, dtype=torch.uint8)
        _pad_into(out, rect, piece)
        return _finish(out.view(_dtype(piece.dst_dtype, piece)), piece)
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
        if piece.transform in (Transform.COPY, Transform.PAD_COLS):
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
    """A contiguous tensor's bytes as a flat uint8 view (``t`` itself when it is one: each
    torch call drops and retakes the GIL, on the transfer's event loop too)."""
    if t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous():
        return t
    return t.contiguous().reshape(-1).view(torch.uint8)


def _check_out(out: torch.Tensor, piece: Piece) -> None:
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"piece {_describe(piece)}: the output must be a flat, contiguous "
                         f"uint8 buffer, not {out.dtype} of shape {tuple(out.shape)}")
    if out.numel() != piece.nbytes:
        raise ValueError(f"piece {_describe(piece)}: output buffer holds {out.numel()} B, "
                         f"the piece has {piece.nbytes}")


def _copy_into(out: torch.Tensor, src: torch.Tensor, piece: Piece) -> None:
    """Copy ``src`` (any dtype and strides) into ``out``'s bytes as the piece's dtype."""
    dtype = _dtype(piece.dst_dtype, piece)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if src.numel() * itemsize != piece.nbytes:
        raise ValueError(f"piece {_describe(piece)}: the source holds {src.numel()} elements "
                         f"of {dtype} = {src.numel() * itemsize} B, expected {piece.nbytes}")
    out.view(dtype).view(src.shape).copy_(src)


def prepare_pieces_into(
    full: torch.Tensor, pieces: Sequence[Piece], outs: Sequence[torch.Tensor], *,
    views: bool | Sequence[bool] = False,
) -> list[torch.Tensor]:
    """:func:`prepare_pieces` written into ``outs`` (flat uint8, ``piece.nbytes`` each).

    Returns each piece's bytes: its ``out``, or with ``views`` (for every piece, or one
    flag per piece: the zero-copy ones) a view of ``full`` where the piece needs no copy.
    """
    if len(outs) != len(pieces):
        raise ValueError(f"{len(pieces)} pieces but {len(outs)} output buffers")
    flags = [views] * len(pieces) if isinstance(views, bool) else list(views)
    cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    ready = []
    for piece, out, view in zip(pieces, outs, flags, strict=True):
        _check_out(out, piece)
        ready.append(out)
        if piece.transform == Transform.COPY:
            rect = source_rect(full, piece)
            if view and rect.dtype == _dtype(piece.dst_dtype, piece) and rect.is_contiguous():
                ready[-1] = as_bytes(_finish(rect, piece))
                continue
            _copy_into(out, rect, piece)
            continue
        if piece.transform == Transform.PAD_COLS:
            _pad_into(out, source_rect(full, piece), piece)
            continue
        if piece.transform not in (Transform.FP8_WEIGHT, Transform.FP8_SCALE):
            raise ValueError(f"piece {_describe(piece)}: unknown transform {piece.transform!r}")
        if piece.src_slice not in cache:
            rect = source_rect(full, piece)
            if rect.dim() not in (2, 3):
                raise ValueError(f"piece {_describe(piece)}: FP8 needs a 2-D or 3-D rectangle")
            cache[piece.src_slice] = quantize_fp8_blocks(rect)
        w8, scale = cache[piece.src_slice]
        src = w8 if piece.transform == Transform.FP8_WEIGHT else scale
        if src.dtype != _dtype(piece.dst_dtype, piece):
            raise ValueError(f"piece {_describe(piece)}: transform gives {src.dtype}, the piece "
                             f"expects {piece.dst_dtype}")
        _copy_into(out, src, piece)
    return ready


def padded_width(piece: Piece) -> int:
    """The row width of a ``PAD_COLS`` piece: its bytes over the rectangle's rows; ValueError
    naming the piece unless that is a whole number of columns, at least the rectangle's."""
    shape = piece.src_shape
    itemsize = torch.empty((), dtype=_dtype(piece.dst_dtype, piece)).element_size()
    rows = 1
    for n in shape[:-1]:
        rows *= n
    width, left = divmod(piece.nbytes, rows * itemsize) if shape else (0, 1)
    if left or not shape or width < shape[-1]:
        raise ValueError(f"piece {_describe(piece)}: {piece.nbytes} B is no whole number of "
                         f"rows of at least {shape[-1] if shape else 0} columns")
    return width


def _pad_into(out: torch.Tensor, rect: torch.Tensor, piece: Piece) -> None:
    """``rect`` cast into the left columns of ``out`` (flat uint8, ``piece.nbytes``), zeros in
    the rest of every row."""
    width = padded_width(piece)
    dst = out.view(_dtype(piece.dst_dtype, piece)).view(*rect.shape[:-1], width)
    cols = rect.shape[-1]
    dst[..., :cols].copy_(rect)
    dst[..., cols:].zero_()
