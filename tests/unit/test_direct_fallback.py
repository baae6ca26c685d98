"""Gathered parameters in shard-direct mode: their pieces and tasks are those of ``gather="full"``.

A parameter that falls back to the gather (an FP8 block cut by a trainer shard,
tiny parts, or a small parameter written in many small writes to many engine
ranks: :data:`scheduling.build.direct.MAX_OWNER_WRITES`) keeps the pieces the
engine layout gave it, so a plan where nothing goes shard-direct is the
gather-everything plan, task for task. Table cases for
:func:`scheduling.build.direct_assign.direct_pieces`, then whole small FP8 plans.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from scheduling import compute_plan, load_cluster_config
from scheduling.build.direct import MAX_OWNER_WRITES
from scheduling.build.direct_assign import direct_pieces
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.layout.engine_layout import piece_nbytes
from weight_transfer.model.models import load_model_config
from weight_transfer.types import MeshDesc, ParamMeta, Piece, Placement, Transform

ROOT = Path(__file__).resolve().parents[2]
FSDP = (Placement(kind="shard", dim=0),)


def _meta(shape, ranks):
    return ParamMeta(name="w", shape=shape, dtype="bfloat16",
                     mesh=MeshDesc(ranks=tuple(range(ranks)), shape=(ranks,)), placements=FSDP)


def _whole(shape, transform=Transform.COPY):
    """The whole parameter as one piece (a replicated engine tensor: a router, a norm)."""
    dst = "float8_e4m3fn" if transform == Transform.FP8_WEIGHT else "bfloat16"
    return Piece(dst_tensor="t", dst_offset=0, nbytes=piece_nbytes(shape, transform, dst),
                 dst_dtype=dst, src_param="w", src_slice=tuple((0, n) for n in shape),
                 transform=transform)


# (shape, FSDP ranks, engine shards, engine ranks per shard, transform)
#   -> (direct, reason substring when gathered)
FAN_OUT = [
    # Kimi-K2's router in small: 2-row blocks of 32 KB, each written to 128 engine ranks
    ((64, 8192), 32, 16, 8, Transform.COPY, False, "writes of 32768 B"),
    ((64, 8192), 32, 1, 128, Transform.COPY, False, f"> {MAX_OWNER_WRITES}"),
    # the same blocks to 2 engine ranks: a few writes per owner, direct
    ((64, 8192), 32, 1, 2, Transform.COPY, True, None),
    # 128 writes per owner but of 2 MB each: their fixed cost is small, direct
    ((4096, 8192), 32, 16, 8, Transform.COPY, True, None),
    # FP8 blocks cut by the trainer shards: gathered whatever the fan-out
    ((256, 128), 4, 1, 2, Transform.FP8_WEIGHT, False, "128-row block"),
]


@pytest.mark.parametrize(("shape", "ranks", "shards", "copies", "transform", "direct", "reason"),
                         FAN_OUT)
def test_gathered_parameters_keep_their_pieces(shape, ranks, shards, copies, transform,
                                                direct, reason):
    raw = [[_whole(shape, transform)] for _ in range(shards)]
    out, tags, owner_sets, flags, fallback = direct_pieces(
        raw, [_meta(shape, ranks)], {"w": 0}, "shard_direct", [copies] * shards)
    full = direct_pieces(raw, [_meta(shape, ranks)], {"w": 0}, "full")[0]
    assert bool(flags[0]) == direct
    if direct:
        assert all(len(ps) == ranks for ps in out) and len(owner_sets) == ranks
        assert fallback == ()
    else:
        assert out == full == raw  # the very pieces, no cut
        assert all((t == -1).all() for t in tags) and owner_sets == []
        assert [i for i, _ in fallback] == [0] and reason in fallback[0][1]


def _plans(model: str, cluster: str):
    cfg = load_model_config(ROOT / "configs/models" / f"{model}.yaml")
    cl = load_cluster_config(ROOT / "configs/clusters" / f"{cluster}.yaml")
    tm = trainer_meta_from_config(cfg, cl)
    em = engine_metas_from_config(cfg, cl, fp8=True)
    return [compute_plan(tm, em, cl, model=cfg, fp8=True, gather=g)
            for g in ("shard_direct", "full")]


def _tasks_by_param(plan) -> dict[str, collections.Counter]:
    """Per parameter, its tasks as (destination rank, engine tensor, offset, bytes)."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for k in range(plan.num_tasks):
        p = plan.pieces[plan.task_piece[k]]
        out[p.src_param][(int(plan.task_dst[k]), p.dst_tensor, p.dst_offset, p.nbytes)] += 1
    return out


@pytest.mark.parametrize(("model", "cluster"), [("tiny_deepseek_v3", "local_cpu"),
                                                ("tiny_moe", "local_cpu_hsdp")])
def test_fp8_plan_adds_tasks_only_for_direct_parameters(model, cluster):
    direct, full = _plans(model, cluster)
    direct.validate()
    assert direct.fallback and direct.direct_params  # both kinds present
    names = {direct.params[i].name for i in direct.direct_params}
    got, want = _tasks_by_param(direct), _tasks_by_param(full)
    assert set(got) == set(want)
    for name in want:
        if name not in names:  # gathered: the full plan's tasks exactly
            assert got[name] == want[name], name
    extra = direct.num_tasks - full.num_tasks
    assert extra == sum(sum(got[n].values()) - sum(want[n].values()) for n in names)
