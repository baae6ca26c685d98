"""Shard-direct pieces: which pieces a rank's own block covers, which are gathered, and why.

Tables of small cases for :func:`scheduling.build.direct.cover_piece` and the block
geometry it rests on (:mod:`weight_transfer.layout.shard_blocks`), then whole plans:
sources fixed by ownership (FSDP) or chosen among replicas (HSDP), every check
of a corrupt shard-direct plan.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from scheduling import compute_plan, load_cluster_config
from scheduling.build.direct import cover_piece
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.layout.engine_layout import piece_nbytes
from weight_transfer.layout.shard_blocks import dim_cuts, local_rect, owners_at, shifted
from weight_transfer.sender.executor import check_trainer_plan, own_block
from weight_transfer.sender.prepare import piece_bytes
from weight_transfer.types import MeshDesc, ParamMeta, Piece, Placement, Transform

ROOT = Path(__file__).resolve().parents[2]
S0, S1, R = (Placement(kind="shard", dim=0), Placement(kind="shard", dim=1),
             Placement(kind="replicate"))


def meta(shape, mesh_shape=(4,), placements=(S0,), dtype="bfloat16"):
    n = int(np.prod(mesh_shape))
    return ParamMeta(name="w", shape=shape, dtype=dtype,
                     mesh=MeshDesc(ranks=tuple(range(n)), shape=mesh_shape),
                     placements=placements)


def piece(rect, transform=Transform.COPY, dtype="bfloat16", offset=0):
    dst = "float8_e4m3fn" if transform == Transform.FP8_WEIGHT else (
        "float32" if transform == Transform.FP8_SCALE else dtype)
    shape = tuple(b - a for a, b in rect)
    return Piece(dst_tensor="t", dst_offset=offset, nbytes=piece_nbytes(shape, transform, dst),
                 dst_dtype=dst, src_param="w", src_slice=tuple(rect), transform=transform)


# (placements and mesh, global shape) -> (rank, its block), torch.chunk's cuts
BLOCKS = [
    ((S0,), (4,), (1024, 64), 1, ((256, 512), (0, 64))),
    ((S0,), (4,), (10, 3), 3, ((9, 10), (0, 3))),  # chunks of 3: the last rank holds 1 row
    ((S0,), (4,), (2, 3), 3, ((2, 2), (0, 3))),  # chunks of 1: ranks 2, 3 hold none
    ((R, S0), (2, 2), (8, 4), 3, ((4, 8), (0, 4))),  # HSDP: rank 3 = (1, 1)
    ((S0, S1), (2, 2), (4, 8, 2), 1, ((0, 2), (4, 8), (0, 2))),  # EP x FSDP stacked experts
    ((R,), (4,), (5, 5), 2, ((0, 5), (0, 5))),  # replicated: every rank holds it whole
]


@pytest.mark.parametrize(("placements", "mesh_shape", "shape", "rank", "block"), BLOCKS)
def test_blocks_are_torch_chunk_blocks(placements, mesh_shape, shape, rank, block):
    m = meta(shape, mesh_shape, placements)
    assert local_rect(m, rank) == block
    assert local_rect(m, 99) is None  # not on the mesh


def test_owners_and_cuts():
    hsdp = meta((8, 4), (2, 2), (R, S0))
    assert owners_at(hsdp, (5, 0)) == (1, 3)  # both replicas of the second shard
    assert dim_cuts(hsdp) == ((4,), ())
    assert dim_cuts(meta((10, 3))) == ((3, 6, 9), ())
    assert owners_at(meta((4, 8, 2), (2, 2), (S0, S1)), (3, 5, 1)) == (3,)


# (param, piece rect, transform) -> (parts, first part's owners, reason substring or None)
COVER = [
    # column-parallel slice inside one FSDP block: one part, one owner
    (meta((1024, 64)), ((256, 384), (0, 64)), Transform.COPY, 1, (1,), None),
    # row-parallel engine slice of dim-0 shards: one strided part per block
    (meta((1024, 64)), ((0, 1024), (32, 64)), Transform.COPY, 4, (0,), None),
    # fused part spanning two blocks
    (meta((1024, 64)), ((128, 640), (0, 64)), Transform.COPY, 3, (0,), None),
    # HSDP: the part has both replicas as sources
    (meta((1024, 64), (2, 2), (R, S0)), ((0, 1024), (0, 64)), Transform.COPY, 2, (0, 2), None),
    # EP x FSDP experts cut on rows: one part per (expert, row block)
    (meta((4, 1024, 32), (2, 2), (S0, S1)), ((0, 4), (0, 1024), (0, 32)), Transform.COPY, 8,
     (0,), None),
    # replicated parameter: one part, every rank a source
    (meta((1024, 64), (4,), (R,)), ((0, 512), (0, 64)), Transform.COPY, 1, (0, 1, 2, 3), None),
    # FP8: shards of 256 rows hold whole 128-row blocks
    (meta((1024, 128)), ((0, 1024), (0, 128)), Transform.FP8_WEIGHT, 4, (0,), None),
    (meta((1024, 128)), ((0, 1024), (0, 128)), Transform.FP8_SCALE, 4, (0,), None),
    # FP8: shards of 64 rows cut 128-row blocks -> gathered
    (meta((256, 128)), ((0, 256), (0, 128)), Transform.FP8_WEIGHT, 0, None, "128-row block"),
    # FP8: a piece starting off a shard boundary: blocks relative to the piece are cut
    (meta((1024, 128)), ((64, 576), (0, 128)), Transform.FP8_WEIGHT, 0, None, "128-row block"),
    # FP8: shards on the columns
    (meta((128, 1024), (4,), (S1,)), ((0, 128), (0, 1024)), Transform.FP8_WEIGHT, 0, None,
     "columns"),
    # tiny parts (a norm over many ranks) -> gathered
    (meta((1024,), (4,)), ((0, 1024),), Transform.COPY, 0, None, "parts of 512 source B"),
    # Partial placement: no rank holds a block of its own
    (meta((1024, 64), (4,), (Placement(kind="partial"),)), ((0, 1024), (0, 64)),
     Transform.COPY, 0, None, "Partial"),
]


@pytest.mark.parametrize(("m", "rect", "transform", "parts", "owners", "reason"), COVER)
def test_cover_decision(m, rect, transform, parts, owners, reason):
    p = piece(rect, transform, offset=1000)
    cov = cover_piece(p, m)
    assert len(cov.parts) == parts
    if reason is None:
        assert cov.direct and cov.reason == ""
        assert cov.parts[0][1] == owners
        # parts tile the piece's destination range in order, each inside its owners' blocks
        offsets = [q.dst_offset for q, _ in cov.parts]
        assert offsets[0] == 1000
        assert [a + q.nbytes for a, (q, _) in zip(offsets, cov.parts, strict=True)] == [
            *offsets[1:], 1000 + p.nbytes]
        for q, srcs in cov.parts:
            for r in srcs:
                block = local_rect(m, r)
                assert all(a0 <= a < b <= b0 for (a, b), (a0, b0)
                           in zip(q.src_slice, block, strict=True))
    else:
        assert not cov.direct and reason in cov.reason


@pytest.mark.parametrize("transform", [Transform.COPY, Transform.FP8_WEIGHT, Transform.FP8_SCALE])
def test_parts_cut_from_blocks_give_the_pieces_bytes(transform):
    """Bytes of every part, cut from its owner's block alone, laid at its offset, equal the
    whole piece prepared from the full tensor."""
    m = meta((4, 512, 256), (2, 2), (S0, S1), dtype="float32")
    full = torch.randn(m.shape, generator=torch.Generator().manual_seed(0))
    p = piece(((1, 4), (0, 512), (0, 256)), transform)
    want = piece_bytes(full, p)
    got = torch.zeros_like(want)
    for part, owners in cover_piece(p, m).parts:
        block = local_rect(m, owners[0])
        local = full[tuple(slice(a, b) for a, b in block)].clone()
        lo = part.dst_offset - p.dst_offset
        got[lo:lo + part.nbytes] = piece_bytes(local, shifted(part, block))
    assert torch.equal(got, want)


def _plan(cluster: str, model: str = "tiny_llama", gather="shard_direct", fp8=False):
    cfg = load_model_config_(model)
    cl = load_cluster_config(ROOT / "configs/clusters" / cluster)
    tm = trainer_meta_from_config(cfg, cl)
    em = engine_metas_from_config(cfg, cl, fp8=fp8)
    return compute_plan(tm, em, cl, model=cfg, fp8=fp8, gather=gather), tm


def load_model_config_(name):
    from weight_transfer.model.models import load_model_config

    return load_model_config(ROOT / "configs/models" / f"{name}.yaml")


@pytest.mark.parametrize("cluster", ["local_cpu.yaml", "local_cpu_hsdp.yaml"])
def test_direct_sources_hold_their_blocks_and_stay_balanced(cluster):
    plan, tm = _plan(cluster, "bench_dense")
    plan.validate()
    direct = plan.task_direct()
    nbytes = plan.task_nbytes()
    assert nbytes[direct].sum() / nbytes.sum() > 0.99  # all but the norms
    send = plan.send_bytes().sum(axis=0)
    assert send.max() / send.mean() < 1.05
    for r in tm.ranks:  # what each rank receives says which parameters it writes locally
        tp = plan.trainer_plan(r.rank)
        local = {n for g in tp.groups for n in g.local}
        gathered = {n for g in tp.groups for n in g.params}
        assert local and not local & gathered
        assert {t.piece.src_param for t in tp.tasks} <= local | gathered


def test_hsdp_spreads_direct_pieces_over_both_replicas():
    plan, _ = _plan("local_cpu_hsdp.yaml", "bench_dense")
    direct = plan.task_direct()
    # (dp_replicate=2, dp_shard=2): every rank sends shard-direct bytes
    per_rank = np.bincount(plan.task_src[direct], weights=plan.task_nbytes()[direct],
                           minlength=4)
    assert (per_rank > 0).all()


def test_full_mode_has_no_direct_piece():
    plan, _ = _plan("local_cpu.yaml", gather="full")
    assert plan.gather == "full" and plan.direct_params == () and not plan.task_direct().any()
    assert all(not g.local for g in plan.trainer_plan(0).groups)


def test_unknown_gather_mode_names_the_choices():
    with pytest.raises(ValueError, match="shard_direct"):
        _plan("local_cpu.yaml", gather="fast")


def test_validate_refuses_a_direct_task_from_a_rank_without_the_block():
    plan, _ = _plan("local_cpu.yaml")
    direct = np.flatnonzero(plan.task_direct())
    row = int(direct[0])
    src = plan.task_src.copy()
    src[row] = (src[row] + 1) % len(plan.trainer_ranks)
    bad = dataclasses.replace(plan, task_src=src)
    with pytest.raises(ValueError, match=r"shard-direct piece .* source rank"):
        bad.validate()


def test_a_trainer_refuses_a_local_task_outside_its_block():
    plan, tm = _plan("local_cpu.yaml")
    tp = plan.trainer_plan(0)
    g = next(g for g in tp.groups if g.local)
    t = next(t for t in g.tasks if t.piece.src_param in g.local)
    far = tm.params[[p.name for p in tm.params].index(t.piece.src_param)].shape[0]
    moved = dataclasses.replace(t, piece=dataclasses.replace(
        t.piece, src_slice=((far - 1, far), *t.piece.src_slice[1:])))
    lean = dataclasses.replace(tp, groups=(dataclasses.replace(g, tasks=(moved,)),))
    with pytest.raises(ValueError, match="not inside the block the rank holds"):
        check_trainer_plan(lean, tm.params)


def test_own_block_refuses_a_local_tensor_of_the_wrong_shape():
    m = meta((8, 4))
    assert own_block(m, torch.zeros(8, 4), 1)[1] == ((2, 4), (0, 4))  # cut from the whole
    with pytest.raises(ValueError, match="'w' holds a local block of shape"):
        own_block(m, torch.zeros(3, 4), 1)


def test_simulated_gathers_vanish_for_shard_direct_parameters():
    from scheduling import simulate

    cl = load_cluster_config(ROOT / "configs/clusters/local_cpu.yaml")
    cl = cl.model_copy(update={"sim": cl.sim.model_copy(update={"intra_node_gbps": 1.0})})
    stages = {}
    for gather in ("full", "shard_direct"):
        cfg = load_model_config_("bench_dense")
        tm = trainer_meta_from_config(cfg, cl)
        plan = compute_plan(tm, engine_metas_from_config(cfg, cl), cl, model=cfg, gather=gather)
        r = simulate(plan, cl, nic_model="bound")
        stages[gather] = r.stage_seconds["gather"]
    assert stages["full"] > 0.1
    assert stages["shard_direct"] < 0.01 * stages["full"]  # the norms' buckets alone


def test_piece_scale_scales_the_bytes_on_the_wire():
    from scheduling import simulate

    plan, _ = _plan("local_cpu.yaml")
    cl = load_cluster_config(ROOT / "configs/clusters/local_cpu.yaml")
    whole = simulate(plan, cl, nic_model="bound")
    half = simulate(plan, cl, nic_model="bound", piece_scale=0.5)
    assert half.lower_bound_seconds == pytest.approx(whole.lower_bound_seconds / 2, rel=1e-3)
    none = simulate(plan, cl, nic_model="bound", piece_scale=np.zeros(len(plan.pieces)))
    assert none.lower_bound_seconds == 0.0
    with pytest.raises(ValueError, match="piece bytes"):
        simulate(plan, cl, piece_scale=np.ones(3))


def test_simulate_gather_modes_side_by_side():
    from actors.tools.cli.gather_modes import simulate_gather_modes

    rows = simulate_gather_modes(ROOT / "configs/models/tiny_llama.yaml",
                                 ROOT / "configs/clusters/local_cpu_hsdp.yaml",
                                 nic_model="bound")
    assert list(rows) == ["full", "shard_direct"]
    assert rows["full"]["direct_bytes_fraction"] == 0.0
    assert rows["shard_direct"]["direct_bytes_fraction"] > 0.5
    assert rows["shard_direct"]["gathered_params"] < rows["full"]["gathered_params"]
    for s in rows.values():
        assert s["predicted_s"] >= s["lower_bound_s"] > 0 and s["binding"]


def test_plan_blobs_with_inconsistent_direct_fields_are_refused():
    import msgpack

    from scheduling.serialize import dumps_plan, loads_plan
    from weight_transfer.plan.wire import dumps_trainer_plan, loads_trainer_plan

    plan, _ = _plan("local_cpu.yaml")
    back = loads_plan(dumps_plan(plan))
    assert (back.gather, back.direct_params, back.fallback) == (
        plan.gather, plan.direct_params, plan.fallback)
    raw = msgpack.unpackb(dumps_plan(plan), strict_map_key=False)
    raw["direct_params"] = list(reversed(raw["direct_params"]))
    with pytest.raises(ValueError, match="direct_params must be ascending"):
        loads_plan(msgpack.packb(raw))
    raw = msgpack.unpackb(dumps_plan(plan), strict_map_key=False)
    raw["strings"].append("full")
    raw["gather"] = len(raw["strings"]) - 1
    with pytest.raises(ValueError, match="'full' lists direct_params"):
        loads_plan(msgpack.packb(raw))
    raw = msgpack.unpackb(dumps_trainer_plan(plan.trainer_plan(0)), strict_map_key=False)
    raw["groups"][0][4] = raw["groups"][0][4] + raw["groups"][0][4][:1]
    with pytest.raises(ValueError, match="listed twice in local"):
        loads_trainer_plan(msgpack.packb(raw))
