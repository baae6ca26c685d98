"""Engine-side layout: the tensors one engine rank holds and the pieces that fill them.

For a model config and one engine rank's :class:`ShardSpec`,
:func:`engine_tensor_specs` lists its tensors (vLLM names, local shapes,
dtypes) and :func:`engine_pieces` the :class:`Piece` list that covers every
byte of them exactly once, each piece one contiguous destination range and the
rectangle of one trainer parameter (global coordinates) it comes from::

    specs = engine_tensor_specs(cfg, ShardSpec(tp_rank=1, tp_size=4), fp8=True)
    pieces = engine_pieces(cfg, ShardSpec(tp_rank=1, tp_size=4), fp8=True)
    check_mapping(cfg, fp8=True, expert_naming="stacked", trainer_names=names,
                  tp_size=4, ep_size=1)

The cuts are vLLM's; :mod:`weight_transfer.layout.shard_geometry` describes them (TP
fused parts, replicated KV heads, vocab padding, EP experts) and
:mod:`weight_transfer.model.naming` holds the rule tables. FP8: a quantized weight
becomes ``float8_e4m3fn`` plus ``<name>_scale_inv`` float32 scales of 128x128
blocks; each fused part is quantized on its own, so every part but the last must
fill whole blocks, and a TP/EP cut that splits a block is a ValueError naming the
tensor (vLLM refuses the same shapes). Each FP8 weight piece has a scale piece
from the same source rectangle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from weight_transfer.layout.fp8_geometry import (
    FP8_BLOCK,
    FP8_DTYPE,
    SCALE_DTYPE,
    block_cuts,
    scale_shape,
)
from weight_transfer.layout.shard_geometry import TensorLayout, gc_paused, tensor_layouts
from weight_transfer.model.models import ModelConfig, check_expert_naming, trainer_param_shapes
from weight_transfer.model.naming import name_problems, scale_name
from weight_transfer.types import Piece, ShardSpec, TensorSpec, Transform, dtype_size


def engine_tensor_specs(
    cfg: ModelConfig, shard: ShardSpec, *, fp8: bool, ignore: Iterable[str] = ()
) -> list[TensorSpec]:
    """The tensors of one engine rank (vLLM name, local shape, dtype); an FP8 weight is
    followed by its scale tensor."""
    out = []
    for lay in tensor_layouts(cfg, shard, ignore=tuple(ignore)):
        if fp8 and lay.rule.fp8:
            out.append(TensorSpec(name=lay.rule.engine, shape=lay.shape, dtype=FP8_DTYPE))
            out.append(
                TensorSpec(
                    name=scale_name(lay.rule.engine),
                    shape=scale_shape(lay.shape),
                    dtype=SCALE_DTYPE,
                )
            )
        else:
            out.append(TensorSpec(name=lay.rule.engine, shape=lay.shape, dtype=lay.rule.dtype))
    return out


def piece_nbytes(src_shape: tuple[int, ...], transform: Transform, dst_dtype: str) -> int:
    """Destination bytes of a rectangle after ``transform``."""
    if transform == Transform.FP8_SCALE:
        return math.prod(scale_shape(src_shape)) * dtype_size(SCALE_DTYPE)
    return math.prod(src_shape) * dtype_size(dst_dtype)


def part_bytes(src: tuple[tuple[int, int], ...], rect: tuple[tuple[int, int], ...],
               transform: Transform, dst_dtype: str) -> tuple[int, int]:
    """(byte offset in the piece, bytes) of the part of a piece with source ``src`` whose
    source is ``rect``: leading dims of extent 1, one dim cut, trailing dims whole, so
    its destination is one contiguous range of the piece's."""
    full = tuple(b - a for a, b in src)
    offset = 0
    for d, ((a, _), (a0, _)) in enumerate(zip(rect, src, strict=True)):
        if a > a0:
            offset += piece_nbytes((1,) * d + (a - a0,) + full[d + 1:], transform, dst_dtype)
    return offset, piece_nbytes(tuple(b - a for a, b in rect), transform, dst_dtype)


def _check_blocks(lay: TensorLayout, shapes: dict, shard: ShardSpec, memo: dict | None = None):
    """ValueError if a quantized tensor's shard cuts an FP8 block. Each (cuts, source
    shapes) once: ``memo`` remembers those found whole (every MoE layer repeats one)."""
    cuts = lay.cuts
    fulls = tuple(shapes[src].shape for src in lay.sources)
    key = ("blocks whole", cuts, lay.shape[-2], fulls)
    if memo is not None and key in memo:
        return
    for i, (rect, r0, full) in enumerate(zip(cuts.rects, cuts.r0, fulls, strict=True)):
        n = rect[-2][1] - rect[-2][0]
        bad = block_cuts(rect, full, (r0, r0 + n), lay.shape[-2])
        if bad:
            raise ValueError(
                f"FP8 {FP8_BLOCK}x{FP8_BLOCK} blocks cut by the layout of {lay.rule.engine} "
                f"on {shard} (from {lay.sources[i]}): " + "; ".join(bad)
            )
    if memo is not None:
        memo[key] = True


def _geometry(lay: TensorLayout, quant: bool, esize: int) -> tuple[tuple, tuple]:
    """(offset, bytes, rect) of each source's weight piece and, if ``quant``, scale piece."""
    cuts = lay.cuts
    rows, cols = (lay.shape[0], 1) if len(lay.shape) == 1 else lay.shape[-2:]
    sizes = {r: math.prod([b - a for a, b in r]) * esize for r in dict.fromkeys(cuts.rects)}
    weights = tuple(
        ((b0 * rows + r0) * cols * esize, sizes[rect], rect)
        for rect, b0, r0 in zip(cuts.rects, cuts.b0, cuts.r0, strict=True)
    )
    if not quant:
        return weights, ()
    srows, scols = scale_shape(lay.shape)[-2:]
    sizes = {r: piece_nbytes(tuple(b - a for a, b in r), Transform.FP8_SCALE, SCALE_DTYPE)
             for r in sizes}
    scales = tuple(
        ((b0 * srows + r0 // FP8_BLOCK) * scols * 4, sizes[rect], rect)
        for rect, b0, r0 in zip(cuts.rects, cuts.b0, cuts.r0, strict=True)
    )
    return weights, scales


def _pieces_of(lay: TensorLayout, fp8: bool, shapes: dict, shard: ShardSpec,
               memo: dict) -> list[Piece]:
    quant = fp8 and lay.rule.fp8
    name, dtype = lay.rule.engine, FP8_DTYPE if quant else lay.rule.dtype
    key = (lay.cuts, lay.shape, quant, dtype)  # layouts sharing cuts share the geometry
    geometry = memo.get(key)
    if geometry is None:
        geometry = memo[key] = _geometry(lay, quant, dtype_size(dtype))
    weights, scales = geometry
    transform = Transform.FP8_WEIGHT if quant else Transform.COPY
    out = [
        Piece(dst_tensor=name, dst_offset=off, nbytes=n, dst_dtype=dtype, src_param=src,
              src_slice=rect, transform=transform)
        for src, (off, n, rect) in zip(lay.sources, weights, strict=True)
    ]
    if not quant:
        return out
    _check_blocks(lay, shapes, shard, memo)
    sname = scale_name(name)
    out += [
        Piece(dst_tensor=sname, dst_offset=off, nbytes=n, dst_dtype=SCALE_DTYPE, src_param=src,
              src_slice=rect, transform=Transform.FP8_SCALE)
        for src, (off, n, rect) in zip(lay.sources, scales, strict=True)
    ]
    return out


def engine_pieces(
    cfg: ModelConfig,
    shard: ShardSpec,
    *,
    fp8: bool,
    expert_naming: str = "per_expert",
    ignore: Iterable[str] = (),
) -> list[Piece]:
    """Pieces covering every byte of every tensor of ``shard`` exactly once.

    Order: tensors as :func:`engine_tensor_specs` lists them, within a tensor by
    destination offset. ``src_slice`` is in global coordinates of ``src_param``.
    """
    key = ("pieces", shard, fp8, expert_naming, tuple(ignore))
    return list(cfg.cached(key, lambda: _build_pieces(cfg, shard, fp8, expert_naming, key[-1])))


def _build_pieces(cfg, shard, fp8, expert_naming, ignore) -> tuple[Piece, ...]:
    shapes = trainer_param_shapes(cfg, expert_naming=expert_naming)
    out: list[Piece] = []
    memo: dict = {}
    with gc_paused():
        for lay in tensor_layouts(cfg, shard, expert_naming=expert_naming, ignore=ignore):
            out += _pieces_of(lay, fp8, shapes, shard, memo)
    return tuple(out)


def check_mapping(
    cfg: ModelConfig,
    *,
    fp8: bool,
    expert_naming: str,
    trainer_names: Iterable[str],
    tp_size: int,
    ep_size: int,
    ignore: Iterable[str] = (),
) -> None:
    """ValueError listing every trainer parameter without a destination and every
    engine tensor without a source (names matching ``ignore`` or the config's
    ``ignore_params``, fnmatch patterns, excepted), then every layout problem of
    the TP/EP degrees (divisibility, FP8 blocks cut by a shard)."""
    check_expert_naming(expert_naming)
    patterns = tuple(ignore) + cfg.ignore_params
    problems = name_problems(cfg, expert_naming, trainer_names, patterns)
    problems += _layout_problems(cfg, fp8, tp_size, ep_size, patterns)
    if problems:
        raise ValueError(
            f"mapping of {cfg.name or cfg.architecture} (fp8={fp8}, expert_naming="
            f"{expert_naming}, tp_size={tp_size}, ep_size={ep_size}) is incomplete:\n"
            + "\n".join(problems)
        )


def _layout_problems(cfg, fp8, tp_size, ep_size, patterns) -> list[str]:
    """Layout errors over all distinct shards. TP and EP cuts are independent, so rank
    r = (r % tp, r % ep) for r < max(tp, ep) meets every TP rank and every EP rank
    (with tp == ep: exactly the shards of vLLM with expert parallelism)."""
    shards = [
        ShardSpec(tp_rank=r % tp_size, tp_size=tp_size, ep_rank=r % ep_size, ep_size=ep_size)
        for r in range(max(tp_size, ep_size))
    ]
    shapes = trainer_param_shapes(cfg)
    problems: list[str] = []
    memo: dict = {}
    for shard in shards:
        try:  # geometry only, no pieces: per_expert names are the checkpoint's
            for lay in tensor_layouts(cfg, shard, ignore=patterns):
                if fp8 and lay.rule.fp8:
                    _check_blocks(lay, shapes, shard, memo)
        except ValueError as exc:
            if str(exc) not in problems:
                problems.append(str(exc))
    return problems


def split_piece(piece: Piece, max_bytes: int) -> list[Piece]:
    """Split ``piece`` into pieces of at most ``max_bytes`` where the layout allows.

    Splits along the first source dimension of extent > 1 (leading extent-1
    dimensions keep each part's destination contiguous), never inside one row
    (the last dimension). FP8 pieces split only between experts or on 128-row
    block boundaries, so weight and scale sub-pieces hold the blocks the whole
    piece would. A piece that cannot be split further may exceed ``max_bytes``.
    """
    if max_bytes <= 0:
        raise ValueError(f"split_piece: max_bytes must be positive, not {max_bytes}")
    shape = piece.src_shape
    if piece.nbytes <= max_bytes or len(shape) < 2:
        return [piece]
    dim = next((d for d in range(len(shape) - 1) if shape[d] > 1), None)
    if dim is None:
        return [piece]
    fp8 = piece.transform != Transform.COPY
    unit = FP8_BLOCK if fp8 and dim == len(shape) - 2 else 1

    def nbytes(extent: int) -> int:
        sub = (*shape[:dim], extent, *shape[dim + 1 :])
        return piece_nbytes(sub, piece.transform, piece.dst_dtype)

    per_unit = nbytes(unit)
    step = max(1, max_bytes // per_unit) * unit
    if step >= shape[dim]:
        return [piece]
    out = []
    a0 = piece.src_slice[dim][0]
    for start in range(0, shape[dim], step):
        stop = min(shape[dim], start + step)
        rect = list(piece.src_slice)
        rect[dim] = (a0 + start, a0 + stop)
        out.append(
            Piece(
                dst_tensor=piece.dst_tensor,
                dst_offset=piece.dst_offset + nbytes(start),
                nbytes=nbytes(stop - start),
                dst_dtype=piece.dst_dtype,
                src_param=piece.src_param,
                src_slice=tuple(rect),
                transform=piece.transform,
            )
        )
    return out
