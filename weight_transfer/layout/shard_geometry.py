"""Shard geometry: where the sources of each rule land on one engine rank.

:func:`tensor_layouts` gives, for a model config and one engine rank's
:class:`ShardSpec`, every engine tensor's local shape, its sources (trainer
names) and their :class:`Cuts`: per source a rectangle of the trainer parameter
(global coordinates) and the (expert, row) where it lands in the local tensor.
Layouts that cut alike share one ``Cuts`` object (every MoE layer's experts),
so that derived geometry is computed once per object, not per layer.
:mod:`weight_transfer.layout.engine_layout` turns these into byte pieces; this module
knows no bytes and no dtypes.

The cuts are vLLM's (see :mod:`weight_transfer.model.naming` for the tables):

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
  ``inter`` is the architecture's expert size (``cfg.expert_intermediate_size``).

Sources are the trainer names of the chosen expert naming (:func:`rule_sources`):
under ``stacked`` naming a rule may read other names than its checkpoint sources.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

from weight_transfer.model.models import ModelConfig, check_expert_naming, trainer_param_shapes
from weight_transfer.model.naming import (
    EXPERT_SPLITS,
    BoundRule,
    Split,
    bound_rules,
    expert_sources,
    matches,
    rule_sources,
)
from weight_transfer.types import ShardSpec

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


Rect = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, eq=False)
class Cuts:
    """Where a layout's sources land: per source a trainer rectangle (global
    coordinates) and the (batch ``b0``, row ``r0``) of the local tensor it fills.

    Layouts that cut alike share one object (the experts of every MoE layer of a
    rank, the same projection of every layer): whatever is derived from the cuts
    alone (byte offsets, FP8 block checks) is computed once per object. Compared
    by identity.
    """

    rects: tuple[Rect, ...]
    b0: tuple[int, ...]
    r0: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """One engine tensor of one rank: its rule, local shape, and where each source
    (trainer parameter name, in order) lands (``cuts``, aligned with ``sources``)."""

    rule: BoundRule
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    cuts: Cuts


def _cut(n: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if n % parts:
        raise ValueError(f"{what}: size {n} is not divisible by {parts} ranks")
    size = n // parts
    return rank * size, size


def _rows(
    cfg: ModelConfig, rule: BoundRule, part: int, src: str, n: int, s: ShardSpec
) -> tuple[int, int]:
    """(start, length) of a fused part's rows that rank ``s`` holds."""
    what = f"{rule.engine} part {part} ({src}) over tp_size={s.tp_size}"
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


def _dense_layout(
    cfg: ModelConfig, rule: BoundRule, s: ShardSpec, shapes: dict, naming: str, interned: dict
) -> TensorLayout:
    sources = rule_sources(rule, naming)
    rects, r0s, local_rows, cols = [], [], 0, None
    for part, src in enumerate(sources):
        shape = _shape(shapes, src, rule)
        start, n = _rows(cfg, rule, part, src, shape[0], s)
        rect = ((start, start + n),)
        if len(shape) == 2:
            c0, nc = (0, shape[1])
            if rule.split == Split.ROW:
                c0, nc = _cut(shape[1], s.tp_size, s.tp_rank, f"{rule.engine} input dim")
            if cols not in (None, nc):
                raise ValueError(f"{rule.engine}: fused parts have {cols} and {nc} columns")
            cols, rect = nc, ((start, start + n), (c0, c0 + nc))
        rects.append(rect)
        r0s.append(local_rows)
        local_rows += n
    shape = (local_rows,) if cols is None else (local_rows, cols)
    key = (tuple(rects), tuple(r0s))  # the same projection of every layer: one Cuts
    cuts = interned.get(key)
    if cuts is None:
        cuts = interned[key] = Cuts(key[0], (0,) * len(rects), key[1])
    return TensorLayout(rule, shape, tuple(sources), cuts)


def _expert_layout(
    cfg: ModelConfig, rule: BoundRule, s: ShardSpec, shapes: dict, naming: str
) -> TensorLayout:
    n_exp, inter, h = cfg.n_experts, cfg.expert_intermediate_size, cfg.hidden_size
    if s.ep_size > 1:  # whole experts per EP rank, no TP inside the MoE
        what = f"{rule.engine} over ep_size={s.ep_size} (experts)"
        e0, el = _cut(n_exp, s.ep_size, s.ep_rank, what)
        mt, mr = 1, 0
    else:
        e0, el, mt, mr = 0, n_exp, s.tp_size, s.tp_rank
    what = f"{rule.engine} {cfg.arch.expert_size_field} over tp_size={mt}"
    c0, il = _cut(inter, mt, mr, what)
    column = rule.split == Split.EXPERTS_COLUMN
    shape = (el, 2 * il, h) if column else (el, h, il)
    if naming == "stacked":
        (src,) = expert_sources(rule, 0, naming)
        _shape(shapes, src, rule)
        if column and mt > 1:
            pairs = [(e, k) for e in range(e0, e0 + el) for k in range(2)]
            rects = [((e, e + 1), (k * inter + c0, k * inter + c0 + il), (0, h)) for e, k in pairs]
            return TensorLayout(rule, shape, (src,) * len(pairs), Cuts(
                tuple(rects), tuple(e - e0 for e, _ in pairs), tuple(k * il for _, k in pairs)))
        rect = ((e0, e0 + el), (0, 2 * inter), (0, h)) if column else (
            (e0, e0 + el), (0, h), (c0, c0 + il))
        return TensorLayout(rule, shape, (src,), Cuts((rect,), (0,), (0,)))
    names = _expert_names(cfg, rule, shapes)
    sources = tuple(src for e in range(e0, e0 + el) for src in names[e])
    parts = len(names[0]) if names else 0
    # every layer and every EP rank cuts its experts alike: one Cuts per geometry
    cuts = cfg.cached(("expert_cuts", column, el, parts, c0, il, h),
                      lambda: _expert_cuts(column, el, parts, c0, il, h))
    return TensorLayout(rule, shape, sources, cuts)


def _expert_cuts(column: bool, el: int, parts: int, c0: int, il: int, h: int) -> Cuts:
    rect = ((c0, c0 + il), (0, h)) if column else ((0, h), (c0, c0 + il))
    return Cuts((rect,) * (el * parts), tuple(b for b in range(el) for _ in range(parts)),
                tuple(k * il for _ in range(el) for k in range(parts)))


def _expert_names(cfg: ModelConfig, rule: BoundRule, shapes: dict) -> tuple:
    """Per-expert source names of a rule, checked against the trainer specs once."""

    def build() -> tuple:
        names = tuple(expert_sources(rule, e, "per_expert") for e in range(cfg.n_experts))
        for srcs in names:
            for src in srcs:
                _shape(shapes, src, rule)
        return names

    return cfg.cached(("expert_names", rule.engine), build)


def _shape(shapes: dict, src: str, rule: BoundRule) -> tuple[int, ...]:
    try:
        return shapes[src].shape
    except KeyError:
        raise ValueError(f"{rule.engine}: source {src!r} is not a trainer parameter") from None


def tensor_layouts(
    cfg: ModelConfig, shard: ShardSpec, *, expert_naming: str = "per_expert", ignore=()
) -> tuple[TensorLayout, ...]:
    """Local shape and source segments of every engine tensor of ``shard``, in order
    (memoized on the config)."""
    check_expert_naming(expert_naming)
    key = ("layouts", shard, expert_naming, tuple(ignore))
    return cfg.cached(key, lambda: _layouts(cfg, shard, expert_naming, key[-1]))


def _layouts(cfg: ModelConfig, shard: ShardSpec, expert_naming: str, ignore: tuple):
    if cfg.n_experts and cfg.n_experts % shard.ep_size:
        raise ValueError(f"ep_size={shard.ep_size} does not divide {cfg.n_experts} experts")
    if cfg.num_attention_heads % shard.tp_size:  # vLLM asserts this for every attention
        raise ValueError(
            f"tp_size={shard.tp_size} does not divide num_attention_heads="
            f"{cfg.num_attention_heads}"
        )
    shapes = trainer_param_shapes(cfg, expert_naming=expert_naming)
    patterns = tuple(ignore) + cfg.ignore_params
    out, interned = [], {}
    with gc_paused():
        for rule in bound_rules(cfg):
            if matches(rule.engine, patterns):
                continue
            if rule.split in EXPERT_SPLITS:
                out.append(_expert_layout(cfg, rule, shard, shapes, expert_naming))
            else:
                layout = _dense_layout(cfg, rule, shard, shapes, expert_naming, interned)
                if layout.shape[0]:
                    out.append(layout)
    return tuple(out)


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic GC while building ~10^5 acyclic objects: its full passes over the
    live plan otherwise cost more than building it (measured 3x at Kimi-K2 scale)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
