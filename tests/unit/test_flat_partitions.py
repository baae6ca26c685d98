"""ZeRO-3's flat partitions as a placement the plan understands (``Flat()``), pure and fast.

Tables of small cases for the range geometry (:mod:`weight_transfer.layout.flat_blocks`)
and the parts a piece is cut into (:mod:`scheduling.build.direct_flat`: whole rows,
partial rows at the edges, padding, row-parallel slices, FP8 block boundaries, tiny
parts gathered), checked against brute force; then whole plans of tiny_llama on 2 flat
ranks into TP=1 and TP=2 engines (bytes direct vs gathered, ZeRO-1/2 replicated) and
their execution through :class:`~weight_transfer.sender.executor.RankTransfer` from
:class:`~weight_transfer.sender.flat_shard.FlatShard` partitions, byte for byte against
the reference loader.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.tools.testkit.simnic_engines import SimnicEngines, one_replica_cluster
from scheduling import compute_plan
from scheduling.build.direct_flat import cover_flat
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.layout.engine_layout import piece_nbytes
from weight_transfer.layout.flat_blocks import (
    FLAT,
    count_below,
    flat_range,
    flat_ranges,
    holds_flat,
    run_rects,
)
from weight_transfer.layout.shard_blocks import held, holds, local_rect, ownership
from weight_transfer.model.models import load_model_config
from weight_transfer.plan.check import check_trainer_plan
from weight_transfer.sender.flat_shard import FlatShard, flat_view
from weight_transfer.types import MeshDesc, ParamMeta, Placement, TrainerMeta, Transform

ROOT = Path(__file__).resolve().parents[2]
COPY, W8, S8 = Transform.COPY, Transform.FP8_WEIGHT, Transform.FP8_SCALE


def flat_meta(shape, n=2, dtype="bfloat16"):
    return ParamMeta(name="w", shape=tuple(shape), dtype=dtype,
                     mesh=MeshDesc(ranks=tuple(range(n)), shape=(n,)), placements=(FLAT,))


def mesh(n):
    return MeshDesc(ranks=tuple(range(n)), shape=(n,))


# (numel, ranks) -> each rank's (start, stop): ceil(numel / n) each, the last short or empty
RANGES = [
    (131072, 2, [(0, 65536), (65536, 131072)]),
    (70, 3, [(0, 24), (24, 48), (48, 70)]),  # the last partition padded by 2
    (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # ranks 2 and 3 hold padding only
]


@pytest.mark.parametrize(("numel", "n", "want"), RANGES)
def test_ranges_are_zero3_partitions_with_padding_at_the_end(numel, n, want):
    assert flat_ranges(numel, n) == want
    m = flat_meta((numel,), n)
    assert [flat_range(m, r) for r in range(n)] == want
    assert flat_range(m, 99) is None
    assert ownership(m) == "flat" and local_rect(m, 0) is None


# (rect, [lo, hi) of its row-major order) -> rectangles: partial rows at the edges
RUNS = [
    (((0, 4), (0, 5)), 3, 17, [((0, 1), (3, 5)), ((1, 3), (0, 5)), ((3, 4), (0, 2))]),
    (((0, 4), (0, 5)), 5, 15, [((1, 3), (0, 5))]),  # whole rows only
    (((2, 6), (1, 4)), 4, 5, [((3, 4), (2, 3))]),  # inside one row
    (((0, 2), (0, 3), (0, 4)), 5, 20,  # 3-D: partial row, partial plane, whole planes...
     [((0, 1), (1, 2), (1, 4)), ((0, 1), (2, 3), (0, 4)), ((1, 2), (0, 2), (0, 4))]),
    (((0, 3),), 1, 2, [((1, 2),)]),
]


@pytest.mark.parametrize(("rect", "lo", "hi", "want"), RUNS)
def test_runs_are_rectangles_in_order(rect, lo, hi, want):
    assert run_rects(rect, lo, hi) == want


def elements(rect):
    return set(itertools.product(*(range(a, b) for a, b in rect)))


def test_count_and_runs_agree_with_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        rect = tuple(sorted(rng.sample(range(n + 1), 2)) for n in shape)
        rect = tuple((a, b) for a, b in rect)
        flat = {p: int(np.ravel_multi_index(p, shape)) for p in elements(rect)}
        f = rng.randint(0, math.prod(shape))
        assert count_below(rect, shape, f) == sum(v < f for v in flat.values())
        n = rng.randint(1, 5)
        got: list = []
        for f0, f1 in flat_ranges(math.prod(shape), n):
            lo, hi = count_below(rect, shape, f0), count_below(rect, shape, f1)
            parts = run_rects(rect, lo, hi)
            inside = {p for p, v in flat.items() if f0 <= v < f1}
            assert set().union(*map(elements, parts)) == inside if parts else not inside
            got += parts
        assert sorted(p for r in got for p in elements(r)) == sorted(flat)


def piece(rect, transform=COPY, dtype="bfloat16"):
    from weight_transfer.types import Piece

    dst = {W8: "float8_e4m3fn", S8: "float32"}.get(transform, dtype)
    shape = tuple(b - a for a, b in rect)
    return Piece(dst_tensor="t", dst_offset=0, nbytes=piece_nbytes(shape, transform, dst),
                 dst_dtype=dst, src_param="w", src_slice=tuple(rect), transform=transform)


# (shape, ranks, piece source, transform) -> (part rects, owners) or a reason's words
COVER = [
    # TP=1 engine: each rank's slice is whole rows, one part each
    ((512, 256), 2, ((0, 512), (0, 256)), COPY,
     [(((0, 256), (0, 256)), 0), (((256, 512), (0, 256)), 1)]),
    # a dim-0 engine shard (TP=2 column-parallel) inside one rank's range: one part
    ((512, 256), 2, ((256, 512), (0, 256)), COPY, [(((256, 512), (0, 256)), 1)]),
    # ranges starting and ending inside rows: whole rows plus a partial row at each edge
    ((1000, 256), 3, ((0, 1000), (0, 256)), COPY,
     [(((0, 333), (0, 256)), 0), (((333, 334), (0, 86)), 0),
      (((333, 334), (86, 256)), 1), (((334, 666), (0, 256)), 1), (((666, 667), (0, 172)), 1),
      (((666, 667), (172, 256)), 2), (((667, 1000), (0, 256)), 2)]),
    # row-parallel engine slice: each rank's rows of it, strided
    ((256, 512), 2, ((0, 256), (256, 512)), COPY,
     [(((0, 128), (256, 512)), 0), (((128, 256), (256, 512)), 1)]),
    # row-parallel slice the cut row crosses outside [c0, c1): nothing of the piece is cut
    ((1000, 256), 3, ((0, 1000), (0, 64)), COPY,
     [(((0, 334), (0, 64)), 0), (((334, 667), (0, 64)), 1), (((667, 1000), (0, 64)), 2)]),
    # FP8 where every range starts on a 128-row block: cut there
    ((512, 256), 2, ((0, 512), (0, 256)), W8,
     [(((0, 256), (0, 256)), 0), (((256, 512), (0, 256)), 1)]),
    ((512, 256), 2, ((0, 512), (0, 256)), S8,
     [(((0, 256), (0, 256)), 0), (((256, 512), (0, 256)), 1)]),
    # FP8 cut inside a block or a row, tiny parts, a 1-D FP8 source: gathered, and why
    ((384, 256), 2, ((0, 384), (0, 256)), W8, "cuts a 128-row block"),
    ((1000, 256), 3, ((0, 1000), (0, 256)), W8, "cuts a row"),
    ((256,), 2, ((0, 256),), COPY, "source B on average"),
]


@pytest.mark.parametrize(("shape", "n", "src", "transform", "want"), COVER)
def test_pieces_are_cut_where_partitions_meet(shape, n, src, transform, want):
    got = cover_flat(src, transform, piece(src, transform).dst_dtype, shape, mesh(n),
                     16 << 10)
    if isinstance(want, str):
        assert isinstance(got, str) and want in got
        return
    assert [(rect, owners) for rect, _, _, owners in got] == [(r, (o,)) for r, o in want]
    whole = piece(src, transform)
    offset = 0
    for rect, off, nbytes, (owner,) in got:  # contiguous, in order, covering the piece
        assert off == offset and nbytes == piece_nbytes(
            tuple(b - a for a, b in rect), transform, whole.dst_dtype)
        assert holds_flat(flat_meta(shape, n), owner, rect)
        offset += nbytes
    assert offset == whole.nbytes


def test_holds_and_held_speak_for_flat_and_blocks():
    m = flat_meta((10, 7), 3)
    assert holds(m, 1, ((3, 4), (3, 7))) and not holds(m, 0, ((3, 4), (3, 7)))
    assert held(m, 2) == "flat elements [48, 70)" and held(m, 5) == "no range"
    fsdp = dataclasses.replace(m, placements=(Placement(kind="shard", dim=0),))
    assert holds(fsdp, 1, ((4, 8), (0, 7))) and held(fsdp, 1) == "block [(4, 8), (0, 7)]"
    two_d = dataclasses.replace(m, mesh=MeshDesc(ranks=(0, 1, 2, 3), shape=(2, 2)),
                                placements=(Placement(kind="replicate"), FLAT))
    assert "only alone on a 1-D mesh" in ownership(two_d)


def test_flat_view_cuts_a_rectangle_from_the_partition_without_a_copy():
    full = torch.arange(70, dtype=torch.float32).reshape(10, 7)
    start, stop = flat_ranges(70, 3)[1]
    data = torch.zeros(24)
    data[: stop - start] = full.reshape(-1)[start:stop]
    shard = FlatShard(data=data, shape=(10, 7), start=start, group=None, world=3)
    assert shard.valid == 24
    for rect in (((4, 6), (0, 7)), ((3, 4), (3, 7)), ((4, 7), (0, 3))):
        if holds_flat(flat_meta((10, 7), 3), 1, rect):
            view = flat_view(shard, rect)
            assert view.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            assert torch.equal(view, full[tuple(slice(a, b) for a, b in rect)])
    with pytest.raises(ValueError, match=r"the rank holds \[24, 48\)"):
        flat_view(shard, ((2, 4), (0, 7)))


# ------------------------------------------------------------------ whole plans of tiny_llama


def cluster(tp, world=2, fp8=False):
    return one_replica_cluster(trainer_ranks=world, tp=tp, fp8=fp8)


def model():
    return load_model_config(ROOT / "configs" / "models" / "tiny_llama.yaml")


def zero_meta(cfg, cl, placements=(FLAT,)) -> TrainerMeta:
    """Every parameter flat over every trainer rank (ZeRO-3), or replicated (ZeRO-1/2)."""
    tm = trainer_meta_from_config(cfg, cl)
    n = len(tm.ranks)
    m = MeshDesc(ranks=tuple(range(n)), shape=(n,))
    return TrainerMeta(params=tuple(dataclasses.replace(p, mesh=m, placements=placements)
                                    for p in tm.params), ranks=tm.ranks)


def direct_and_gathered(plan) -> tuple[int, int]:
    nbytes, direct = plan.task_nbytes(), plan.task_direct()
    return int(nbytes[direct].sum()), int(nbytes[~direct].sum())


NORMS = 5 * 256 * 2  # two norms per layer and the final one, 256 bf16 each


@pytest.mark.parametrize("tp", [1, 2])
def test_zero3_plan_writes_partitions_direct_and_gathers_only_the_norms(tp):
    cfg, cl = model(), cluster(tp)
    tm = zero_meta(cfg, cl)
    plan = compute_plan(tm, engine_metas_from_config(cfg, cl), cl, model=cfg)
    plan.validate()
    direct, gathered = direct_and_gathered(plan)
    assert direct + gathered == plan.bytes_total
    assert gathered == NORMS * tp  # every engine rank holds the norms whole
    assert {tm.params[i].name for i, _ in plan.fallback} == {
        p.name for p in tm.params if len(p.shape) == 1}
    # every direct task reads inside its source rank's range, and both ranks send
    assert set(plan.task_src[plan.task_direct()].tolist()) == {0, 1}
    full = compute_plan(tm, engine_metas_from_config(cfg, cl), cl, model=cfg, gather="full")
    assert direct_and_gathered(full) == (0, plan.bytes_total)


def test_zero12_replicated_source_spreads_writes_over_every_rank():
    cfg, cl = model(), cluster(2)
    tm = zero_meta(cfg, cl, placements=(Placement(kind="replicate"),))
    plan = compute_plan(tm, engine_metas_from_config(cfg, cl), cl, model=cfg)
    plan.validate()
    assert direct_and_gathered(plan)[1] == 0
    sent = plan.send_bytes().sum(axis=0)
    assert len(sent) == 2 and max(sent) / min(sent) < 1.1


def partition(full: torch.Tensor, rank: int, n: int) -> FlatShard:
    """What ZeRO-3 keeps in ``ds_tensor`` on ``rank``: its padded flat slice."""
    p = -(-full.numel() // n)
    flat = torch.zeros(p * n, dtype=full.dtype)
    flat[: full.numel()] = full.reshape(-1)
    return FlatShard(data=flat[rank * p : (rank + 1) * p].clone(), shape=tuple(full.shape),
                     start=rank * p, group=None, world=n)


# 2 ranks cut every matrix of tiny_llama between rows; 3 ranks inside rows (partial rows
# at the edges: 1000 x 256 in slices of 85334 elements), FP8 then gathers what it cuts
@pytest.mark.parametrize(("tp", "fp8", "world"),
                         [(1, False, 2), (2, False, 2), (2, True, 2), (2, False, 3), (1, True, 3)])
def test_partitions_land_the_reference_bytes(tp, fp8, world):
    cfg, cl = model(), cluster(tp, world, fp8)
    state = random_state_dict(cfg, seed=5)
    tm = zero_meta(cfg, cl)
    with SimnicEngines(engine_metas_from_config(cfg, cl, fp8=fp8)) as eng:
        plan = compute_plan(tm, eng.engines, cl, model=cfg, fp8=fp8)
        plan.validate()
        direct = {tm.params[i].name for i in plan.direct_params}
        assert "model.layers.0.self_attn.q_proj.weight" in direct or (fp8 and world == 3)
        if world == 3:  # slices start inside rows: parts of one row written on their own
            rows = [p for p in plan.pieces if p.src_param == "model.embed_tokens.weight"
                    and p.src_shape[0] == 1]
            assert rows and all(p.src_shape[1] < 256 for p in rows)
        for rank in range(world):
            check_trainer_plan(plan.trainer_plan(rank), tm.params)
            # a direct parameter from the rank's own partition; a gathered one whole (one
            # process: the gather itself runs in tests/integration/test_deepspeed_trainers.py)
            locals_ = {n: partition(t, rank, world) if n in direct else t
                       for n, t in state.items()}
            report = eng.run(plan, tm.params, rank, locals_.__getitem__)
            assert report.params_local == len([g for g in plan.trainer_plan(rank).groups
                                                for _ in g.local])
            assert report.bytes_written == report.bytes_planned
        assert eng.mismatches(cfg, state, fp8=fp8) == []
