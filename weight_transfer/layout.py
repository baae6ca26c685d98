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

The cuts are vLLM's (see :mod:`weight_transfer.naming` for the tables):

* fused column-parallel tensors hold ``[part0_shard; part1_shard; ...]``; q is cut
  by heads and k/v heads are replicated when ``tp_size > num_kv_heads``;
* row-parallel tensors are cut on the input dimension;
* vocab-parallel tensors: vLLM pads the vocabulary to a multiple of 64 and gives
  rank r rows ``[r*P, (r+1)*P)`` of the padded vocab (``P = padded / tp``). The
  padding rows have no source, so the engine tensor described here is the
  prefix of vLLM's local tensor that holds real rows: same address, fewer rows;
  the padding rows stay as the engine initialised them and are never written.
  A rank whose rows are all padding has no such tensor;
* experts: with ``ep_size > 1`` rank ``ep_rank`` holds the contiguous range of
  ``E / ep_size`` whole experts; with ``ep_size == 1`` every rank holds all
  experts cut by TP on the intermediate dimension (vLLM without expert
  parallelism). ``w13_weight`` is ``[E_local, 2*inter_local, hidden]``, gate then up;
* FP8: a quantized weight becomes ``float8_e4m3fn`` plus ``<name>_scale_inv``
  float32 scales of 128x128 blocks. Each fused part is quantized on its own, so
  every part but the last must fill whole blocks; a TP/EP cut that splits a block
  is a ValueError naming the tensor (vLLM refuses the same shapes).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterable
from dataclasses import dataclass

from weight_transfer.models import ModelConfig, check_expert_naming, trainer_param_shapes
from weight_transfer.naming import (
    EXPERT_SPLITS,
    BoundRule,
    Split,
    bound_rules,
    expert_sources,
    matches,
    name_problems,
    scale_name,
)
from weight_transfer.quant import FP8_BLOCK
from weight_transfer.types import Piece, ShardSpec, Transform, dtype_size

FP8_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineTensorSpec:
    """One tensor of one engine rank: vLLM name, local (per-rank) shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True, slots=True)
class Segment:
    """A trainer rectangle landing at (batch ``b0``, row ``r0``) of a local tensor."""

    src: str
    rect: tuple[tuple[int, int], ...]
    b0: int
    r0: int


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """One engine tensor of one rank: its rule, local shape and source segments."""

    rule: BoundRule
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]


def _cut(n: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if n % parts:
        raise ValueError(f"{what}: size {n} is not divisible by {parts} ranks")
    size = n // parts
    return rank * size, size


def _rows(cfg: ModelConfig, rule: BoundRule, part: int, n: int, s: ShardSpec) -> tuple[int, int]:
    """(start, length) of a fused part's rows that rank ``s`` holds."""
    what = f"{rule.engine} part {part} ({rule.sources[part]}) over tp_size={s.tp_size}"
    if rule.split in (Split.REPLICATED, Split.ROW):
        return 0, n
    if rule.split == Split.COLUMN:
        return _cut(n, s.tp_size, s.tp_rank, what)
    if rule.split == Split.VOCAB:
        padded = -(-n // VOCAB_PADDING) * VOCAB_PADDING
        start, per = _cut(padded, s.tp_size, s.tp_rank, what + " (vocab padded to 64)")
        return start, max(0, min(n, start + per) - start)
    # QKV: q by heads; k and v by kv heads, replicated when tp_size > num_kv_heads
    hd, tp, r = n // (cfg.num_attention_heads if part == 0 else cfg.kv_heads), s.tp_size, s.tp_rank
    if part == 0:
        start, heads = _cut(cfg.num_attention_heads, tp, r, what + " (attention heads)")
        return start * hd, heads * hd
    if tp >= cfg.kv_heads:
        if tp % cfg.kv_heads:
            raise ValueError(f"{what}: {cfg.kv_heads} kv heads cannot be replicated evenly")
        return (r // (tp // cfg.kv_heads)) * hd, hd
    start, heads = _cut(cfg.kv_heads, tp, r, what + " (kv heads)")
    return start * hd, heads * hd


def _dense_layout(cfg: ModelConfig, rule: BoundRule, s: ShardSpec, shapes: dict) -> TensorLayout:
    segments, local_rows, cols = [], 0, None
    for part, src in enumerate(rule.sources):
        shape = _shape(shapes, src, rule)
        start, n = _rows(cfg, rule, part, shape[0], s)
        rect = ((start, start + n),)
        if len(shape) == 2:
            c0, nc = (0, shape[1])
            if rule.split == Split.ROW:
                c0, nc = _cut(shape[1], s.tp_size, s.tp_rank, f"{rule.engine} input dim")
            if cols not in (None, nc):
                raise ValueError(f"{rule.engine}: fused parts have {cols} and {nc} columns")
            cols, rect = nc, ((start, start + n), (c0, c0 + nc))
        segments.append(Segment(src, rect, 0, local_rows))
        local_rows += n
    shape = (local_rows,) if cols is None else (local_rows, cols)
    return TensorLayout(rule, shape, tuple(segments))


def _expert_layout(
    cfg: ModelConfig, rule: BoundRule, s: ShardSpec, shapes: dict, naming: str
) -> TensorLayout:
    n_exp, inter, h = cfg.n_experts, cfg.moe_intermediate_size or 0, cfg.hidden_size
    what = f"{rule.engine} over ep_size={s.ep_size}"
    if s.ep_size > 1:  # whole experts per EP rank, no TP inside the MoE
        e0, el = _cut(n_exp, s.ep_size, s.ep_rank, what + " (experts)")
        mt, mr = 1, 0
    else:
        e0, el, mt, mr = 0, n_exp, s.tp_size, s.tp_rank
    c0, il = _cut(inter, mt, mr, f"{rule.engine} moe_intermediate_size over tp_size={mt}")
    column = rule.split == Split.EXPERTS_COLUMN
    segments: list[Segment] = []
    if naming == "stacked":
        (src,) = expert_sources(rule, 0, naming)
        _shape(shapes, src, rule)
        if column and mt > 1:
            segments = [
                Segment(src, ((e, e + 1), (k * inter + c0, k * inter + c0 + il), (0, h)),
                        e - e0, k * il)
                for e in range(e0, e0 + el) for k in range(2)
            ]
        elif column:
            segments = [Segment(src, ((e0, e0 + el), (0, 2 * inter), (0, h)), 0, 0)]
        else:
            segments = [Segment(src, ((e0, e0 + el), (0, h), (c0, c0 + il)), 0, 0)]
    else:
        for e in range(e0, e0 + el):
            for k, src in enumerate(expert_sources(rule, e, naming)):
                _shape(shapes, src, rule)
                rect = ((c0, c0 + il), (0, h)) if column else ((0, h), (c0, c0 + il))
                segments.append(Segment(src, rect, e - e0, k * il))
    shape = (el, 2 * il, h) if column else (el, h, il)
    return TensorLayout(rule, shape, tuple(segments))


def _shape(shapes: dict, src: str, rule: BoundRule) -> tuple[int, ...]:
    try:
        return shapes[src].shape
    except KeyError:
        raise ValueError(f"{rule.engine}: source {src!r} is not a trainer parameter") from None


def tensor_layouts(
    cfg: ModelConfig, shard: ShardSpec, *, expert_naming: str = "per_expert", ignore=()
) -> list[TensorLayout]:
    """Local shape and source segments of every engine tensor of ``shard``, in order."""
    check_expert_naming(expert_naming)
    if cfg.n_experts and cfg.n_experts % shard.ep_size:
        raise ValueError(f"ep_size={shard.ep_size} does not divide {cfg.n_experts} experts")
    if cfg.num_attention_heads % shard.tp_size:  # vLLM asserts this for every attention
        raise ValueError(
            f"tp_size={shard.tp_size} does not divide num_attention_heads="
            f"{cfg.num_attention_heads}"
        )
    shapes = trainer_param_shapes(cfg, expert_naming=expert_naming)
    patterns = tuple(ignore) + cfg.ignore_params
    out = []
    for rule in bound_rules(cfg):
        if matches(rule.engine, patterns):
            continue
        if rule.split in EXPERT_SPLITS:
            out.append(_expert_layout(cfg, rule, shard, shapes, expert_naming))
        else:
            layout = _dense_layout(cfg, rule, shard, shapes)
            if layout.shape[0]:
                out.append(layout)
    return out


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    *lead, rows, cols = shape
    return (*lead, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def engine_tensor_specs(
    cfg: ModelConfig, shard: ShardSpec, *, fp8: bool, ignore: Iterable[str] = ()
) -> list[EngineTensorSpec]:
    """The tensors of one engine rank; an FP8 weight is followed by its scale tensor."""
    out = []
    for lay in tensor_layouts(cfg, shard, ignore=tuple(ignore)):
        if fp8 and lay.rule.fp8:
            out.append(EngineTensorSpec(name=lay.rule.engine, shape=lay.shape, dtype=FP8_DTYPE))
            out.append(
                EngineTensorSpec(
                    name=scale_name(lay.rule.engine),
                    shape=_scale_shape(lay.shape),
                    dtype=SCALE_DTYPE,
                )
            )
        else:
            spec = EngineTensorSpec(name=lay.rule.engine, shape=lay.shape, dtype=lay.rule.dtype)
            out.append(spec)
    return out


def piece_nbytes(src_shape: tuple[int, ...], transform: Transform, dst_dtype: str) -> int:
    """Destination bytes of a rectangle after ``transform``."""
    if transform == Transform.FP8_SCALE:
        return math.prod(_scale_shape(src_shape)) * dtype_size(SCALE_DTYPE)
    return math.prod(src_shape) * dtype_size(dst_dtype)


def _check_blocks(lay: TensorLayout, seg: Segment, full: tuple[int, ...], shard) -> None:
    """A quantized segment must start on block edges and end on one (or at the edge)."""
    rows = lay.shape[-2]
    n = seg.rect[-2][1] - seg.rect[-2][0]
    bad = [
        f"source {dim} [{a}, {b}) of {extent}"
        for dim, (a, b), extent in zip(("rows", "cols"), seg.rect[-2:], full[-2:], strict=True)
        if a % FP8_BLOCK or (b % FP8_BLOCK and b != extent)
    ]
    if seg.r0 % FP8_BLOCK or (n % FP8_BLOCK and seg.r0 + n != rows):
        bad.append(f"destination rows [{seg.r0}, {seg.r0 + n}) of {rows}")
    if bad:
        raise ValueError(
            f"FP8 {FP8_BLOCK}x{FP8_BLOCK} blocks cut by the layout of {lay.rule.engine} on "
            f"{shard} (from {seg.src}): " + "; ".join(bad)
        )


def _pieces_of(lay: TensorLayout, fp8: bool, shapes: dict, shard: ShardSpec) -> list[Piece]:
    rows, cols = (lay.shape[0], 1) if len(lay.shape) == 1 else lay.shape[-2:]
    quant = fp8 and lay.rule.fp8
    name, dtype = lay.rule.engine, FP8_DTYPE if quant else lay.rule.dtype
    esize = dtype_size(dtype)
    transform = Transform.FP8_WEIGHT if quant else Transform.COPY
    out = [
        Piece(
            dst_tensor=name,
            dst_offset=(seg.b0 * rows + seg.r0) * cols * esize,
            nbytes=math.prod([b - a for a, b in seg.rect]) * esize,
            dst_dtype=dtype,
            src_param=seg.src,
            src_slice=seg.rect,
            transform=transform,
        )
        for seg in lay.segments
    ]
    if not quant:
        return out
    srows, scols = _scale_shape(lay.shape)[-2:]
    sname, checked = scale_name(name), {}
    for seg in lay.segments:
        full = shapes[seg.src].shape
        key = (seg.rect, seg.r0, full)  # experts repeat one geometry: check and size it once
        if key not in checked:
            _check_blocks(lay, seg, full, shard)
            src_shape = tuple(b - a for a, b in seg.rect)
            checked[key] = piece_nbytes(src_shape, Transform.FP8_SCALE, SCALE_DTYPE)
        out.append(
            Piece(
                dst_tensor=sname,
                dst_offset=(seg.b0 * srows + seg.r0 // FP8_BLOCK) * scols * 4,
                nbytes=checked[key],
                dst_dtype=SCALE_DTYPE,
                src_param=seg.src,
                src_slice=seg.rect,
                transform=Transform.FP8_SCALE,
            )
        )
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
    with _gc_paused():
        for lay in tensor_layouts(cfg, shard, expert_naming=expert_naming, ignore=ignore):
            out += _pieces_of(lay, fp8, shapes, shard)
    return tuple(out)


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic GC while building ~10^5 acyclic objects: its full passes over the
    live plan otherwise cost more than building it (measured 3x at Kimi-K2 scale)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
    """Layout errors over all distinct shards (TP and EP cuts are independent)."""
    shards = [ShardSpec(tp_rank=r, tp_size=tp_size, ep_size=ep_size) for r in range(tp_size)]
    shards += [
        ShardSpec(tp_size=tp_size, ep_rank=r, ep_size=ep_size) for r in range(1, ep_size)
    ]
    problems: list[str] = []
    for shard in shards:
        try:
            # Shapes are checked without any trainer name: per_expert is the checkpoint's.
            engine_pieces(cfg, shard, fp8=fp8, ignore=patterns)
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
