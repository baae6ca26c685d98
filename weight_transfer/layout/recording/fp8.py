"""FP8 checkpoints recorded from vLLM: which trainer bytes the engine's FP8 tensors hold.

A block-FP8 checkpoint (vLLM's ``Fp8Config`` with ``weight_block_size``
[128, 128], DeepSeek-V3 style) stores each quantized weight ``x.weight``
[..., R, C] as ``float8_e4m3fn`` with its scales ``x.weight_scale_inv``
[..., ceil(R/128), ceil(C/128)] float32. Trainers hold ``x.weight`` in
bf16/float32. Recorded from vLLM's ``load_weights``, a piece that copies a
rectangle of ``x.weight`` into an FP8 engine tensor becomes an ``FP8_WEIGHT``
piece of the same rectangle, and a piece that copies a rectangle of scale
blocks becomes an ``FP8_SCALE`` piece of the weight rectangle those blocks
cover; both name ``x.weight`` as their source, so the trainer quantizes its
own weight into the engine's layout::

    pieces = fp8_pieces(recorded, {spec.name: spec for spec in checkpoint_specs})

Rectangles must hold whole 128x128 blocks (the last block of a dimension may
be short), or the quantization would differ from the checkpoint's: ValueError
naming the tensor. Pure: no torch, no vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from weight_transfer.layout.fp8_geometry import FP8_BLOCK, FP8_DTYPE, SCALE_DTYPE, scale_shape
from weight_transfer.types import Piece, TensorSpec, Transform

SCALE_SUFFIX = "_scale_inv"


def _whole_blocks(rect: tuple, shape: tuple[int, ...], *, name: str) -> None:
    for (a, b), n in zip(rect[-2:], shape[-2:], strict=True):
        if a % FP8_BLOCK or (b % FP8_BLOCK and b != n):
            raise ValueError(f"{name}: the engine takes rows/columns [{a}, {b}) of {n}, not "
                             f"whole {FP8_BLOCK}x{FP8_BLOCK} FP8 blocks; the trainer cannot "
                             "quantize it as the checkpoint is")


def _scale_piece(p: Piece, weight: TensorSpec) -> Piece:
    """The weight rectangle whose block scales ``p`` copies, as an FP8_SCALE piece."""
    sshape = scale_shape(weight.shape)
    rect = tuple(p.src_slice[:-2]) + tuple(
        (a * FP8_BLOCK, min(b * FP8_BLOCK, n)) for (a, b), n in zip(p.src_slice[-2:],
                                                                    weight.shape[-2:],
                                                                    strict=True))
    blocks = 1
    for (a, b), n in zip(p.src_slice, sshape, strict=True):
        if not 0 <= a < b <= n:
            raise ValueError(f"{p.src_param}: scale rectangle {p.src_slice} outside {sshape}")
        blocks *= b - a
    if blocks * 4 != p.nbytes or p.dst_dtype != SCALE_DTYPE:
        raise ValueError(f"{p.dst_tensor}: filled from {p.src_param} as {p.dst_dtype} "
                         f"({p.nbytes} bytes for {blocks} scales); expected float32 scales")
    return dataclasses.replace(p, src_param=weight.name, src_slice=rect,
                               transform=Transform.FP8_SCALE)


def fp8_pieces(pieces: Iterable[Piece], checkpoint: Mapping[str, TensorSpec]) -> list[Piece]:
    """Recorded pieces with FP8 weights and their scales turned into quantizing pieces of
    the weights (see the module docstring); other pieces unchanged."""
    out = []
    for p in pieces:
        spec = checkpoint[p.src_param]
        base = checkpoint.get(p.src_param.removesuffix(SCALE_SUFFIX))
        if p.src_param.endswith(SCALE_SUFFIX) and base is not None and base.dtype == FP8_DTYPE:
            out.append(_scale_piece(p, base))
        elif spec.dtype == FP8_DTYPE:
            if p.dst_dtype != FP8_DTYPE:
                raise ValueError(f"engine tensor {p.dst_tensor} ({p.dst_dtype}) is filled from "
                                 f"FP8 checkpoint tensor {p.src_param}: loaders that "
                                 "dequantize are not supported")
            _whole_blocks(p.src_slice, spec.shape, name=p.src_param)
            out.append(dataclasses.replace(p, transform=Transform.FP8_WEIGHT))
        else:
            out.append(p)
    return out
