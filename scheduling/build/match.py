"""Match engine tensors to trainer parameters: engine metadata -> pieces per shard.

``match_engines`` asks the layout (:mod:`weight_transfer.layout.engine_layout`) for the
pieces of every distinct engine shard - once per shard, since all replicas
with the same TP/EP coordinates share them - and checks, listing every
problem at once:

* each engine rank exposes exactly the tensors the layout expects for its
  shard, with the same shapes and dtypes (errors name replica, rank, tensor);
* every trainer parameter has a destination and every engine tensor a source
  (``check_mapping``, both directions), unless ignored;
* trainer parameters have the global shapes the model config implies (a vocabulary
  parameter may carry padding rows past ``vocab_size``, as Megatron's does; no piece
  reads them).

Trainer names may carry wrapper prefixes (FSDP, torch.compile); pieces are
renamed to the trainer's own names so that tasks name what the trainer holds::

    pieces_by_shard = match_engines(cfg, trainer_meta, engine_metas, fp8=True)
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Iterable, Sequence

from scheduling.build.recorded import has_recorded, recorded_pieces, table_differences
from weight_transfer.layout.engine_layout import (
    check_mapping,
    engine_pieces,
    engine_tensor_specs,
)
from weight_transfer.model.models import ModelConfig, trainer_param_shapes
from weight_transfer.model.naming import (
    TIED_ALIASES,
    Split,
    bound_rules,
    canonical_trainer_name,
    matches,
)
from weight_transfer.types import EngineRankMeta, Piece, ShardSpec, TensorSpec, TrainerMeta

MAX_LISTED = 50
log = logging.getLogger(__name__)
_NAME_SHAPE_DTYPE = operator.attrgetter("name", "shape", "dtype")


def _listing(title: str, problems: list[str]) -> str:
    shown = problems[:MAX_LISTED]
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return f"{title} ({len(problems)}):\n  " + "\n  ".join(shown) + more


def layout_specs(
    cfg: ModelConfig, shard: ShardSpec, *, fp8: bool, ignore: tuple[str, ...] = ()
) -> list[TensorSpec]:
    """``engine_tensor_specs`` memoized on the (immutable) config: replicas and the
    metadata builder ask for the same shards again."""
    key = ("scheduling.layout_specs", shard, fp8, tuple(ignore))
    return cfg.cached(key, lambda: engine_tensor_specs(cfg, shard, fp8=fp8, ignore=ignore))


def engine_problems(
    engines: Sequence[EngineRankMeta], expected: dict[ShardSpec, dict[str, tuple]]
) -> list[str]:
    """Differences between what engines expose and ``expected[shard][name] = (shape, dtype)``."""
    problems = []
    agree = {s: tuple((n, *v) for n, v in want.items()) for s, want in expected.items()}
    for e in engines:
        if tuple(map(_NAME_SHAPE_DTYPE, e.tensors)) == agree[e.shard]:
            continue  # the common case at scale, checked without building dicts
        want = expected[e.shard]
        where = f"{e.replica} rank {e.rank}"
        have = {t.name: t for t in e.tensors}
        for name in sorted(set(want) - set(have)):
            problems.append(f"{where}: tensor {name} missing (layout expects {want[name]})")
        for name in sorted(set(have) - set(want)):
            problems.append(f"{where}: tensor {name} is not in the layout of {e.shard}")
        for name in sorted(set(want) & set(have)):
            t = have[name]
            if (t.shape, t.dtype) != want[name]:
                problems.append(
                    f"{where}: tensor {name} is {t.shape} {t.dtype}, layout expects "
                    f"{want[name][0]} {want[name][1]}"
                )
    return problems


def _padded_rows_ok(name: str, have: tuple[int, ...], want: tuple[int, ...],
                    vocab: frozenset[str]) -> bool:
    """A vocabulary parameter may hold padding rows past ``vocab_size`` (Megatron pads
    to a multiple of 128 x TP); the pieces read only the first ``vocab_size`` rows."""
    return (name in vocab and len(have) == len(want) and have[0] >= want[0]
            and have[1:] == want[1:])


def _shape_problems(
    cfg: ModelConfig, trainer_meta: TrainerMeta, expert_naming: str, canonical: dict[str, str]
) -> list[str]:
    shapes = trainer_param_shapes(cfg, expert_naming=expert_naming)
    vocab = frozenset(s for r in bound_rules(cfg) if r.split == Split.VOCAB for s in r.sources)
    problems = []
    for p in trainer_meta.params:
        name = canonical[p.name]
        spec = shapes.get(name)
        if spec is not None and tuple(spec.shape) != tuple(p.shape) and not _padded_rows_ok(
                name, tuple(p.shape), tuple(spec.shape), vocab):
            problems.append(
                f"trainer parameter {p.name}: shape {p.shape}, the model config implies "
                f"{tuple(spec.shape)}"
            )
    return problems


def _rename(pieces: list[Piece], actual: dict[str, str]) -> list[Piece]:
    if all(k == v for k, v in actual.items()):  # no wrapper prefixes: nothing to rename
        return pieces
    if all(actual.get(p.src_param, p.src_param) == p.src_param for p in pieces):
        return pieces
    return [dataclasses.replace(p, src_param=actual.get(p.src_param, p.src_param)) for p in pieces]


def match_engines(
    cfg: ModelConfig,
    trainer_meta: TrainerMeta,
    engines: Iterable[EngineRankMeta],
    *,
    fp8: bool,
    expert_naming: str = "per_expert",
    ignore: Iterable[str] = (),
) -> dict[ShardSpec, list[Piece]]:
    """Pieces of every distinct shard of ``engines``; ValueError listing all mismatches."""
    engines = tuple(engines)
    ignore = tuple(ignore)
    if not engines:
        raise ValueError("no engine ranks to plan for")
    if has_recorded(engines):  # the engine's own layout; our tables only cross-check it
        pieces = recorded_pieces(trainer_meta, engines, ignore=ignore + cfg.ignore_params)
        for shard, ps in pieces.items():
            diff = table_differences(cfg, shard, ps, expert_naming=expert_naming, fp8=fp8)
            if diff:
                log.warning("the layout recorded from the engine differs from our tables for "
                            "%s on %s: %s", cfg.name or cfg.architecture, shard, diff[:5])
        return pieces
    canonical = {p.name: canonical_trainer_name(p.name) for p in trainer_meta.params}
    actual = {c: n for n, c in canonical.items()}
    shards = list(dict.fromkeys(e.shard for e in engines))
    specs = {s: layout_specs(cfg, s, fp8=fp8, ignore=ignore) for s in shards}
    pieces = {
        s: engine_pieces(cfg, s, fp8=fp8, expert_naming=expert_naming, ignore=ignore)
        for s in shards
    }
    unmatched = _unmatched(cfg, canonical.values(), specs, pieces, ignore)
    if unmatched:
        # check_mapping lists both directions with the layout's own rules; it is
        # slow at scale (it lays out every shard again), so it runs only on failure.
        for tp, ep in dict.fromkeys((s.tp_size, s.ep_size) for s in shards):
            check_mapping(
                cfg,
                fp8=fp8,
                expert_naming=expert_naming,
                trainer_names=canonical.values(),
                tp_size=tp,
                ep_size=ep,
                ignore=ignore,
            )
        raise ValueError(_listing("trainer parameters and engine tensors unmatched", unmatched))
    expected = {s: {t.name: (tuple(t.shape), t.dtype) for t in specs[s]} for s in shards}
    problems = engine_problems(engines, expected)
    if problems:
        raise ValueError(_listing("engine tensors disagree with the layout", problems))
    problems = _shape_problems(cfg, trainer_meta, expert_naming, canonical)
    if problems:
        raise ValueError(_listing("trainer parameters disagree with the model config", problems))
    return {s: _rename(pieces[s], actual) for s in shards}


def _unmatched(
    cfg: ModelConfig,
    trainer_names: Iterable[str],
    specs: dict[ShardSpec, list],
    pieces: dict[ShardSpec, list[Piece]],
    ignore: tuple[str, ...],
) -> list[str]:
    """Trainer params that no piece reads and engine tensors that no piece writes."""
    patterns = ignore + tuple(cfg.ignore_params)
    aliases = TIED_ALIASES if cfg.tie_word_embeddings else ()
    used = {p.src_param for ps in pieces.values() for p in ps}
    out = [
        f"trainer parameter {n}: no destination"
        for n in trainer_names
        if n not in used and n not in aliases and not matches(n, patterns)
    ]
    for s, ts in specs.items():
        written = {p.dst_tensor for p in pieces[s]}
        out += [f"engine tensor {t.name} on {s}: no source" for t in ts if t.name not in written]
    return out
