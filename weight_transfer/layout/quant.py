"""FP8 e4m3 block quantization with float32 ``scale_inv``, as DeepSeek-V3 checkpoints store it.

For every ``block x block`` tile (128 x 128; the last row/column of tiles may be
partial) of a 2-D weight, or of each matrix of a 3-D stack of expert weights::

    scale_inv = amax(|w_tile|) / 448          (float32; 1.0 for an all-zero tile)
    w_fp8     = (w_tile / scale_inv).clamp(-448, 448).to(float8_e4m3fn)
    w         ~ w_fp8.float() * scale_inv      (dequantize_fp8_blocks)

Everything is computed in float32 with elementwise operations per tile, so the
result is deterministic and identical on CPU and CUDA, and quantizing a
block-aligned sub-rectangle gives exactly the tiles of quantizing the whole.
The block geometry without any tensor (for layouts planned at 1T-parameter
scale) is in :mod:`weight_transfer.layout.fp8_geometry`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weight_transfer.layout.fp8_geometry import FP8_BLOCK, FP8_MAX


def _tiles(w: torch.Tensor, block: int) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    if w.dim() not in (2, 3):
        raise ValueError(f"FP8 block quantization takes a 2-D or 3-D tensor, not {tuple(w.shape)}")
    if block <= 0:
        raise ValueError(f"block must be positive, not {block}")
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // block), -(-cols // block)
    if rows % block or cols % block:
        x = F.pad(w.to(torch.float32), (0, nc * block - cols, 0, nr * block - rows))
    else:  # a private copy: the quantizer works on it in place
        x = w.to(torch.float32, copy=True)
    return x.reshape(*w.shape[:-2], nr, block, nc, block), (rows, cols), (nr, nc)


def quantize_fp8_blocks(
    w: torch.Tensor, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` (2-D, or 3-D over its last two dims) to (float8_e4m3fn, float32 scale_inv).

    Shapes: ``w8`` like ``w``; ``scale_inv`` ``[..., ceil(rows/block), ceil(cols/block)]``.
    """
    x, (rows, cols), (nr, nc) = _tiles(w, block)
    # In place on x, with no |x| temporary: the same values, fewer full-size passes.
    lo, hi = x.amin(dim=(-3, -1)), x.amax(dim=(-3, -1))
    amax = torch.maximum(hi, lo.neg_())
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = x.div_(scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*w.shape[:-2], nr * block, nc * block)[..., :rows, :cols]
    return q.contiguous(), scale.contiguous()


def dequantize_fp8_blocks(
    w8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK
) -> torch.Tensor:
    """float32 weights back from FP8 values and their block scales."""
    rows, cols = w8.shape[-2:]
    expect = (*w8.shape[:-2], -(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape) != expect:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{tuple(w8.shape)} in {block}x{block} blocks (expected {expect})"
        )
    s = scale_inv.to(torch.float32)
    s = s.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return w8.to(torch.float32) * s[..., :rows, :cols]
