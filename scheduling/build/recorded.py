"""Pieces recorded from the engine itself (vLLM's ``load_weights``), checked against the
trainer and cross-checked against our rule tables.

An engine rank whose :class:`~weight_transfer.types.EngineRankMeta` carries
``pieces`` brings its own layout, in its checkpoint's names. Here they are
renamed onto the trainer's parameters (:mod:`weight_transfer.model.checkpoint_names`:
stacked transformers-5 experts) and checked both ways, listing every problem
at once: a trainer parameter the engine consumes none of, a checkpoint tensor
the engine consumes that no trainer parameter holds (naming the engine tensor
it fills), an engine tensor no piece fills::

    pieces_by_shard = recorded_pieces(trainer_meta, engine_metas)
    table_differences(cfg, shard, pieces_by_shard[shard], expert_naming="stacked")  # [] if
                                                                    # our tables agree
    engine_table_differences(cfg, engine_meta, trainer_shapes, expert_naming="stacked")
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

from weight_transfer.model.checkpoint_names import to_trainer_pieces
from weight_transfer.model.naming import canonical_trainer_name, matches
from weight_transfer.types import (
    EngineRankMeta,
    Piece,
    ShardSpec,
    TrainerMeta,
    Transform,
    dtype_size,
)

log = logging.getLogger(__name__)


def has_recorded(engines: Sequence[EngineRankMeta]) -> bool:
    """True when every engine rank brings its own layout; ValueError when only some do."""
    flags = {e.pieces is not None for e in engines}
    if len(flags) > 1:
        raise ValueError("some engine ranks bring a recorded layout and some do not: "
                         + ", ".join(str(e.id) for e in engines
                                     if e.pieces is None))
    return flags == {True}


def _shard_problems(e: EngineRankMeta, pieces: list[Piece], missing: list[str],
                    raw: Iterable[Piece]) -> list[str]:
    where = f"{e.replica} rank {e.rank}"
    fills = {}
    for p in raw:
        fills.setdefault(p.src_param, p.dst_tensor)
    out = [f"{where}: engine tensor {fills[n]} is filled from checkpoint tensor {n}, which no "
           "trainer parameter holds" for n in missing]
    written = {p.dst_tensor for p in pieces}
    out += [f"{where}: engine tensor {t.name} has no source" for t in e.tensors
            if t.name not in written and not missing]
    return out


def recorded_pieces(trainer_meta: TrainerMeta, engines: Sequence[EngineRankMeta], *,
                    ignore: Iterable[str] = ()) -> dict[ShardSpec, list[Piece]]:
    """Each distinct shard's recorded pieces, on the trainer's own parameter names."""
    patterns = tuple(ignore)
    actual = {canonical_trainer_name(p.name): p.name for p in trainer_meta.params}
    shapes = {canonical_trainer_name(p.name): tuple(p.shape) for p in trainer_meta.params}
    out: dict[ShardSpec, list[Piece]] = {}
    problems: list[str] = []
    for e in engines:
        if e.shard in out:
            continue
        pieces, missing = to_trainer_pieces(e.pieces, shapes)
        problems += _shard_problems(e, pieces, missing, e.pieces)
        out[e.shard] = [p if actual[p.src_param] == p.src_param
                        else dataclasses.replace(p, src_param=actual[p.src_param])
                        for p in pieces]
    used = {canonical_trainer_name(p.src_param) for ps in out.values() for p in ps}
    problems += [f"trainer parameter {actual[n]}: the engine consumes none of it"
                 for n in shapes if n not in used and not matches(n, patterns)]
    if problems:
        raise ValueError(f"trainer parameters and engine tensors unmatched ({len(problems)}):"
                         "\n  " + "\n  ".join(problems[:50]))
    return out


# Engine names that differ between vLLM versions and our tables (the reference engine's
# names): vLLM 0.3x keeps a MoE layer's routed experts in a `routed_experts` submodule.
ENGINE_NAME_ALIASES = ((".mlp.experts.routed_experts.", ".mlp.experts."),)


def _table_name(name: str) -> str:
    for old, new in ENGINE_NAME_ALIASES:
        name = name.replace(old, new)
    return name


def _units(p: Piece) -> Iterable[tuple]:
    """``p`` as its 2-D matrices, so that layouts that cut stacked (3-D and up) tensors
    into pieces differently (per expert, or all experts at once) compare equal. Linear in
    the number of matrices, not rows: cheap at setup for large models. Keys: (engine
    tensor, element offset, source, rectangle, transform)."""
    keep = 2
    rect, name, t = p.src_slice, _table_name(p.dst_tensor), str(p.transform)
    outer = rect[:-keep] if len(rect) > keep else ()
    inner = rect[len(outer):]
    count = 1
    for a, b in outer:
        count *= b - a
    size = p.nbytes // max(count, 1)
    for i in range(count):
        idx, rest = [], i
        for a, b in reversed(outer):
            idx.append(a + rest % (b - a))
            rest //= b - a
        unit = tuple((j, j + 1) for j in reversed(idx)) + tuple(inner)
        yield (name, (p.dst_offset + i * size) // dtype_size(p.dst_dtype), p.src_param, unit, t)


def _continues(a: tuple, b: tuple) -> bool:
    """Whether copy unit ``b`` carries on ``a``: the next rows of the same matrix, right
    after it in the engine tensor."""
    (name, off, src, rect, t), (name2, off2, src2, rect2, t2) = a, b
    if (name, src, t) != (name2, src2, t2) or t != str(Transform.COPY) or len(rect) < 2:
        return False
    if rect[:-2] != rect2[:-2] or rect[-1] != rect2[-1] or rect[-2][1] != rect2[-2][0]:
        return False
    return off2 == off + (rect[-2][1] - rect[-2][0]) * (rect[-1][1] - rect[-1][0])


def _keys(pieces: Iterable[Piece]) -> set[tuple]:
    """Canonical units: 2-D matrices (:func:`_units`), consecutive row ranges of one copy
    merged, so that row-wise cuts (gate and up halves, or one piece) compare equal too."""
    out, run = set(), None
    for u in sorted(k for p in pieces for k in _units(p)):
        if run is not None and _continues(run, u):
            rect = (*run[3][:-2], (run[3][-2][0], u[3][-2][1]), run[3][-1])
            run = (run[0], run[1], run[2], rect, run[4])
            continue
        if run is not None:
            out.add(run)
        run = u
    if run is not None:
        out.add(run)
    return out


def is_fp8(pieces: Iterable[Piece]) -> bool:
    """True when some piece quantizes (an FP8 engine)."""
    return any(p.transform != Transform.COPY for p in pieces)


def table_differences(cfg, shard: ShardSpec, pieces: Sequence[Piece], *,
                      expert_naming: str, fp8: bool | None = None) -> list[str]:
    """Recorded pieces against the pieces our rule tables give for ``cfg`` (elements, not
    bytes: the engine may compute in another dtype; FP8 when some piece quantizes, unless
    ``fp8`` says); one line per difference."""
    from weight_transfer.layout.engine_layout import engine_pieces

    fp8 = is_fp8(pieces) if fp8 is None else fp8
    table = _keys(engine_pieces(cfg, shard, fp8=fp8, expert_naming=expert_naming))
    got = _keys(pieces)
    return ([f"only recorded: {k}" for k in sorted(got - table)][:20]
            + [f"only in our tables: {k}" for k in sorted(table - got)][:20])


def engine_table_differences(cfg, engine: EngineRankMeta, trainer_shapes: Mapping[str, tuple],
                             *, expert_naming: str) -> list[str]:
    """One engine rank's recorded layout, renamed onto trainer parameters of
    ``trainer_shapes``, against our rule tables: one line per difference (also checkpoint
    tensors no trainer parameter holds); empty when they agree."""
    if engine.pieces is None:
        raise ValueError(f"{engine.replica} rank {engine.rank} brings no recorded layout")
    shapes = {canonical_trainer_name(n): tuple(s) for n, s in trainer_shapes.items()}
    pieces, missing = to_trainer_pieces(engine.pieces, shapes)
    return ([f"checkpoint tensor {n}: no trainer parameter holds it" for n in missing]
            + table_differences(cfg, engine.shard, pieces, expert_naming=expert_naming))
