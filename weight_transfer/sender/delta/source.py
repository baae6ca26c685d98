"""FP8 deltas from the source weights: only the changed elements are quantized again.

Quantizing a whole FP8 piece every update (float32 copy, block amax, divide,
clamp, cast: several passes over the rectangle) costs more than the diff and
the wire together on a capped NIC. For a 2-byte source (bf16, fp16) the trainer
rank keeps the rectangle's source elements beside the FP8 bytes it last wrote
(:class:`KeptSource`, with each 128x128 block's exact amax) and per update:

1. diffs the source rectangle against the kept one, element by element;
2. per block with a changed element, decides whether its amax (so its scale)
   can have changed: a new value above the old amax, or an old value equal to
   it; only then the block's amax is computed again;
3. quantizes each changed element of a block whose scale stayed as
   :func:`~weight_transfer.layout.quant.quantize_fp8_blocks` does (``x / scale_inv``,
   clamped to +-448, cast: the same float32 operations per element, so the same
   byte), and a block whose scale changed whole with it (a block-aligned
   sub-rectangle quantizes to exactly the whole's tiles);
4. writes the new FP8 bytes and scales into the kept ones in place, and returns
   the indices of the FP8 elements and scales that changed (the records' ``idx``).

More than :data:`MAX_CHANGED` of the source changed (a float32-master step, a
high learning rate): :func:`fp8_changes` returns None before touching anything,
and the caller quantizes the piece as usual::

    kept = keep_source(rect)                            # after an anchor's quantization
    got = fp8_changes(kept, rect, w8_bytes, scales)     # next update: None, or
    idx_w8, idx_scale = got                             # w8_bytes, scales now the new ones
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weight_transfer.layout.fp8_geometry import FP8_BLOCK, FP8_MAX
from weight_transfer.layout.quant import quantize_fp8_blocks

MAX_CHANGED = 1 / 8  # of the source elements: above it the piece is quantized whole


@dataclass(slots=True)
class KeptSource:
    """A 2-D source rectangle's elements as last written (flat, 2-byte integers) and each
    block's amax (float32, ``[ceil(rows/128), ceil(cols/128)]``)."""

    data: np.ndarray
    amax: np.ndarray
    shape: tuple[int, int]
    dtype: torch.dtype


def supported(rect: torch.Tensor) -> bool:
    """Whether a source rectangle can take this path (2-D, 2-byte floats, on the host)."""
    return (rect.dim() == 2 and rect.dtype in (torch.bfloat16, torch.float16)
            and rect.device.type == "cpu")


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    nr, nc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    f = torch.nn.functional.pad(x.float().abs(), (0, nc * FP8_BLOCK - cols,
                                                  0, nr * FP8_BLOCK - rows))
    return f.reshape(nr, FP8_BLOCK, nc, FP8_BLOCK).amax(dim=(1, 3))


def keep_source(rect: torch.Tensor) -> KeptSource:
    """A copy of ``rect`` (see :func:`supported`) and its block amaxes."""
    flat = rect.contiguous().reshape(-1).view(torch.int16).numpy().copy()
    return KeptSource(data=flat, amax=_block_amax(rect).numpy().copy(),
                      shape=(rect.shape[0], rect.shape[1]), dtype=rect.dtype)


def _values(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits)).view(dtype).float()


def fp8_changes(kept: KeptSource, rect: torch.Tensor, w8: np.ndarray, scales: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """Bring ``w8`` (uint8, the FP8 bytes of ``kept``'s rectangle) and ``scales`` (float32,
    flat) to ``rect``'s quantization in place; the changed indices of each, or None (more
    than :data:`MAX_CHANGED` changed: nothing was touched)."""
    rows, cols = kept.shape
    if tuple(rect.shape) != kept.shape or rect.dtype != kept.dtype:
        raise ValueError(f"FP8 source delta: rectangle {tuple(rect.shape)} {rect.dtype}, "
                         f"kept {kept.shape} {kept.dtype}")
    # The rectangle as it lies (a row-parallel cut of a shard is strided): compared and read
    # in place, never copied whole. Element by element: a few % of a bf16 source changes
    # per step, too many for the word pass of delta_codec.changed to pay.
    src = rect.view(torch.int16).numpy()
    idx = np.flatnonzero(kept.data.reshape(rows, cols) != src)
    if idx.size > MAX_CHANGED * kept.data.size:
        return None
    nc = -(-cols // FP8_BLOCK)
    r, c = np.divmod(idx, cols)
    bits = src[r, c]  # the changed elements' new bits
    blk = (r // FP8_BLOCK) * nc + c // FP8_BLOCK
    old_v, new_v = _values(kept.data[idx], kept.dtype), _values(bits, kept.dtype)
    amax = kept.amax.reshape(-1)
    top = torch.from_numpy(amax[blk])
    grows = ((new_v.abs() > top) | (old_v.abs() == top)).numpy()
    maybe = np.unique(blk[grows]) if grows.any() else np.empty(0, dtype=blk.dtype)
    redo = []
    for b in maybe.tolist():  # blocks whose amax may have moved: computed again
        br, bc = divmod(b, nc)
        block = rect[br * FP8_BLOCK : (br + 1) * FP8_BLOCK, bc * FP8_BLOCK : (bc + 1) * FP8_BLOCK]
        m = float(block.float().abs().amax())
        if m != amax[b]:
            redo.append(b)
            amax[b] = m
    sel, vals, sel_blk = idx, new_v, blk
    if redo:  # those blocks are quantized whole below
        keep = ~np.isin(blk, redo)
        sel, vals, sel_blk = idx[keep], new_v[torch.from_numpy(keep)], blk[keep]
    q = vals / torch.from_numpy(scales[sel_blk])
    q = q.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    moved = q != w8[sel]
    out = [sel[moved]]
    w8[out[0]] = q[moved]
    grid = w8.reshape(rows, cols)
    scale_idx = []
    for b in redo:  # a new scale: the whole block quantized again
        br, bc = divmod(b, nc)
        rs, cs = slice(br * FP8_BLOCK, (br + 1) * FP8_BLOCK), slice(bc * FP8_BLOCK,
                                                                     (bc + 1) * FP8_BLOCK)
        qb, sb = quantize_fp8_blocks(rect[rs, cs])
        qb = qb.view(torch.uint8).numpy()
        now = grid[rs, cs]
        rr, cc = np.nonzero(qb != now)
        out.append((rr + rs.start) * cols + cc + cs.start)
        now[...] = qb
        s = np.float32(sb.reshape(-1)[0])
        if s.view(np.uint32) != scales[b].view(np.uint32):
            scales[b] = s
            scale_idx.append(b)
    kept.data[idx] = bits
    w8_idx = np.unique(np.concatenate(out)) if redo else out[0]
    return w8_idx.astype(np.int64), np.asarray(sorted(scale_idx), dtype=np.int64)
