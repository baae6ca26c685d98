"""Plan structure, determinism, matching errors and validation errors.

A synthetic setup (hand-written pieces, no layout) pins the structure down;
tiny model configs check matching and determinism end to end.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from scheduling import compute_plan
from scheduling.build.build import build_plan
from scheduling.cluster.config import load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scheduling.serialize import dumps_plan
from weight_transfer.model.models import load_model_config
from weight_transfer.types import (
    EngineRankMeta,
    EngineTensorMeta,
    MeshDesc,
    ParamMeta,
    Piece,
    RankInfo,
    RegionDesc,
    ShardSpec,
    TrainerMeta,
)

ROOT = Path(__file__).resolve().parents[2]
ROW = 16 * 4  # one float32 row of 16 elements


def row_split(piece: Piece, max_bytes: int) -> list[Piece]:
    (r0, r1), *rest = piece.src_slice
    step = max(1, max_bytes // ROW)
    return [
        dataclasses.replace(piece, dst_offset=piece.dst_offset + (a - r0) * ROW,
                            nbytes=(min(r1, a + step) - a) * ROW,
                            src_slice=((a, min(r1, a + step)), *rest))
        for a in range(r0, r1, step)
    ]


def synthetic(replicas=2, tp=2):
    """4 trainer ranks (2 nodes x 2 NICs): dense param ``a`` [8,16] over all ranks,
    experts e0..e3 [4,16] on two EP meshes {0,2} and {1,3}; engine rank t holds
    rows 4t..4t+3 of ``a`` as tensor A and experts 2t, 2t+1 stacked as tensor E."""
    dense = MeshDesc(ranks=(0, 1, 2, 3), shape=(4,))
    ep = [MeshDesc(ranks=(0, 2), shape=(2,)), MeshDesc(ranks=(1, 3), shape=(2,))]
    params = [ParamMeta(name="a", shape=(8, 16), dtype="float32", mesh=dense)]
    params += [ParamMeta(name=f"e{i}", shape=(4, 16), dtype="float32", mesh=ep[i // 2])
               for i in range(4)]
    ranks = [RankInfo(rank=r, node=f"n{r // 2}", nic=f"n{r // 2}/nic{r % 2}") for r in range(4)]
    pieces, engines = {}, []
    for t in range(tp):
        shard = ShardSpec(tp_rank=t, tp_size=tp, ep_rank=t, ep_size=tp)
        pieces[shard] = [Piece(dst_tensor="A", dst_offset=0, nbytes=4 * ROW, dst_dtype="float32",
                               src_param="a", src_slice=((4 * t, 4 * t + 4), (0, 16)))]
        pieces[shard] += [Piece(dst_tensor="E", dst_offset=j * 4 * ROW, nbytes=4 * ROW,
                                dst_dtype="float32", src_param=f"e{2 * t + j}",
                                src_slice=((0, 4), (0, 16))) for j in range(2)]
    for rep in range(replicas):
        for t in range(tp):
            nic = f"i{rep}/nic{t}"
            region = RegionDesc(owner=f"engine{rep}/tp{t}", nic=nic, addr=0x1000,
                                length=12 * ROW, rkey=7)
            tensors = (
                EngineTensorMeta(name="A", shape=(4, 16), dtype="float32", region=region),
                EngineTensorMeta(name="E", shape=(2, 4, 16), dtype="float32", region=region,
                                 offset=4 * ROW),
            )
            engines.append(EngineRankMeta(replica=f"engine{rep}", rank=t, node=f"i{rep}",
                                          nic=nic, shard=ShardSpec(tp_rank=t, tp_size=tp,
                                                                   ep_rank=t, ep_size=tp),
                                          tensors=tensors))
    return TrainerMeta(params=tuple(params), ranks=tuple(ranks)), engines, pieces


def synthetic_plan(**kw):
    tm, engines, pieces = synthetic()
    kw = {"split": row_split, "min_piece_bytes": 1, "pieces_per_nic": 1, **kw}
    return build_plan(tm, engines, pieces, **kw)


def test_synthetic_plan_structure():
    plan = synthetic_plan()
    plan.validate()
    # dense mesh first, then both expert meshes together
    assert [[plan.meshes[m].ranks for m in range(len(plan.meshes)) if plan.mesh_group[m] == g]
            for g in range(plan.num_groups)] == [[(0, 1, 2, 3)], [(0, 2), (1, 3)]]
    # every byte of every engine once: 2 replicas x 2 ranks x 12 rows
    assert plan.bytes_total == 2 * 2 * 12 * ROW
    # one NIC per rank, equal bytes everywhere: perfectly balanced per group
    assert plan.send_bytes().tolist() == [[128 * 2] * 4, [512] * 4]
    assert plan.recv_bytes().tolist() == [[256] * 4, [512] * 4]
    for r in range(4):
        tasks = plan.tasks_for(r)
        assert [t.mesh_group for t in tasks] == sorted(t.mesh_group for t in tasks)
        for t in tasks:
            param = next(p for p in plan.params if p.name == t.piece.src_param)
            assert r in param.mesh.ranks


def test_split_granularity_follows_group_bytes():
    # group 0 sends 256 B per NIC: 2 pieces per NIC -> 4-row pieces split into 2-row pieces
    split = synthetic_plan(pieces_per_nic=2)
    assert {p.nbytes for p in split.pieces if p.src_param == "a"} == {2 * ROW}
    split.validate()
    # group 1 sends 512 B per NIC: 8 per NIC -> 1-row pieces
    assert {p.nbytes for p in synthetic_plan(pieces_per_nic=8).pieces} == {ROW}
    assert {p.nbytes for p in synthetic_plan(pieces_per_nic=1).pieces} == {4 * ROW}
    # a large floor keeps pieces whole
    big = synthetic_plan(min_piece_bytes=1 << 20)
    assert {p.nbytes for p in big.pieces} == {4 * ROW}
    big.validate()


def test_trainer_plan_gathers_every_param_of_its_mesh_in_order():
    plan = synthetic_plan()
    for r in range(4):
        tp = plan.trainer_plan(r)
        assert tp.groups[0].params == ("a",)
        mine = ("e0", "e1") if r in (0, 2) else ("e2", "e3")
        assert set(tp.groups[1].params) == set(mine)
        assert tp.groups[1].mesh.ranks == ((0, 2) if r in (0, 2) else (1, 3))
        pos = {n: i for i, n in enumerate(tp.groups[1].params)}
        seq = [pos[t.piece.src_param] for t in tp.groups[1].tasks]
        assert seq == sorted(seq), "tasks follow the gather order"
    assert plan.param_group == {"a": 0, "e0": 1, "e1": 1, "e2": 1, "e3": 1}
    assert plan.gather_order(0)[0] == ["a"]


def test_same_inputs_same_plan():
    cfg = load_model_config(ROOT / "configs/models/tiny_deepseek_v3.yaml")
    cl = load_cluster_config(ROOT / "configs/clusters/local_cpu.yaml")
    blobs = []
    for _ in range(2):
        tm = trainer_meta_from_config(cfg, cl)
        em = engine_metas_from_config(cfg, cl, fp8=True)
        blobs.append(dumps_plan(compute_plan(tm, em, cl, model=cfg, fp8=True,
                                             min_piece_bytes=1)))
    assert blobs[0] == blobs[1]


# --------------------------------------------------------------------------- build errors


def test_piece_from_unknown_param_is_listed():
    tm, engines, pieces = synthetic()
    tm = dataclasses.replace(tm, params=tm.params[:3])  # drop e2, e3
    with pytest.raises(ValueError, match=r"2 source parameter\(s\) .* not trainer parameters: e2"):
        build_plan(tm, engines, pieces, split=row_split)


def test_engine_without_the_tensor_a_piece_writes():
    tm, engines, pieces = synthetic()
    engines[3] = dataclasses.replace(engines[3], tensors=engines[3].tensors[:1])
    with pytest.raises(ValueError, match="engine1 rank 1: E"):
        build_plan(tm, engines, pieces, split=row_split)


def test_bad_trainer_metadata():
    tm, engines, pieces = synthetic()
    dup = dataclasses.replace(tm, params=(*tm.params, tm.params[0]))
    with pytest.raises(ValueError, match="trainer parameter 'a' listed twice"):
        build_plan(dup, engines, pieces)
    holes = dataclasses.replace(tm, ranks=tm.ranks[1:])
    with pytest.raises(ValueError, match=r"trainer ranks must be 0\.\.2"):
        build_plan(holes, engines, pieces)
    with pytest.raises(ValueError, match="no pieces given for engine shards"):
        build_plan(tm, engines, dict(list(pieces.items())[:1]))


# --------------------------------------------------------------------------- matching errors


def tiny():
    cfg = load_model_config(ROOT / "configs/models/tiny_llama.yaml")
    cl = load_cluster_config(ROOT / "configs/clusters/local_cpu.yaml")
    return cfg, cl, trainer_meta_from_config(cfg, cl), engine_metas_from_config(cfg, cl)


def test_engine_tensor_shape_mismatch_names_replica_rank_tensor():
    cfg, cl, tm, em = tiny()
    t = em[3].tensors[2]
    em[3] = dataclasses.replace(em[3], tensors=(*em[3].tensors[:2],
                                                dataclasses.replace(t, shape=(1, 1)),
                                                *em[3].tensors[3:]))
    with pytest.raises(ValueError, match=rf"engine1 rank 1: tensor {t.name} is \(1, 1\)"):
        compute_plan(tm, em, cl, model=cfg)


def test_unmatched_trainer_params_are_listed_both_ways():
    cfg, cl, tm, em = tiny()
    extra = dataclasses.replace(tm.params[1], name="model.extra.weight")
    without_norm = tuple(p for p in tm.params if p.name != "model.norm.weight")
    bad = dataclasses.replace(tm, params=(*without_norm, extra))
    with pytest.raises(ValueError) as err:
        compute_plan(tm.__class__(params=bad.params, ranks=tm.ranks), em, cl, model=cfg)
    assert "model.extra.weight" in str(err.value)
    assert "model.norm.weight" in str(err.value)
    # ignoring the extra parameter leaves the missing source
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        compute_plan(bad, em, cl, model=cfg, ignore=("model.extra.*",))


def test_trainer_shape_disagreeing_with_config():
    cfg, cl, tm, em = tiny()
    p = tm.params[0]
    bad = dataclasses.replace(tm, params=(dataclasses.replace(p, shape=(3, 3)), *tm.params[1:]))
    with pytest.raises(ValueError, match=rf"{p.name}: shape \(3, 3\), the model config implies"):
        compute_plan(bad, em, cl, model=cfg)


# --------------------------------------------------------------------------- validation errors


def mutate(plan, **cols):
    return dataclasses.replace(plan, **cols)


def test_validate_catches_a_byte_written_twice():
    plan = synthetic_plan(min_piece_bytes=1 << 20)
    i = 0
    cols = {c: np.insert(getattr(plan, c), i, getattr(plan, c)[i])
            for c in ("task_piece", "task_src", "task_dst", "task_region", "task_offset",
                      "task_group")}
    t = plan.task(0)
    with pytest.raises(ValueError, match=rf"{t.dst_replica} rank {t.dst_rank} tensor "
                       rf"{t.piece.dst_tensor}: bytes \[0, {t.nbytes}\) written more than once"):
        mutate(plan, **cols).validate()


def test_validate_catches_missing_bytes():
    plan = synthetic_plan(min_piece_bytes=1 << 20)
    keep = np.arange(plan.num_tasks) != 0
    cols = {c: getattr(plan, c)[keep] for c in ("task_piece", "task_src", "task_dst",
                                                "task_region", "task_offset", "task_group")}
    t = plan.task(0)
    with pytest.raises(ValueError, match=rf"{t.dst_replica} rank {t.dst_rank} tensor "
                       rf"{t.piece.dst_tensor}: bytes \[0, {t.nbytes}\) not written"):
        mutate(plan, **cols).validate()


def test_validate_catches_writes_outside_the_region_and_misplaced():
    plan = synthetic_plan(min_piece_bytes=1 << 20)
    off = plan.task_offset.copy()
    off[0] = 11 * ROW + 8  # runs past the 12-row region
    with pytest.raises(ValueError, match=r"outside region\(owner=engine\d/tp\d") as err:
        mutate(plan, task_offset=off).validate()
    assert "live at" in str(err.value)


def test_validate_catches_wrong_source_rank_and_group():
    plan = synthetic_plan(min_piece_bytes=1 << 20)
    rows = [i for i in range(plan.num_tasks) if plan.task(i).piece.src_param == "e0"]
    src = plan.task_src.copy()
    src[rows[0]] = 1  # rank 1 is not in e0's mesh {0, 2}
    with pytest.raises(ValueError, match="source rank 1 is not in the mesh of e0"):
        mutate(plan, task_src=src).validate()
    grp = plan.task_group.copy()
    grp[rows[0]] = 0
    with pytest.raises(ValueError, match="in mesh group 0, its mesh is in group 1"):
        mutate(plan, task_group=grp).validate()


def test_validate_catches_bad_pieces():
    plan = synthetic_plan(min_piece_bytes=1 << 20)
    pieces = list(plan.pieces)
    pieces[0] = dataclasses.replace(pieces[0], nbytes=pieces[0].nbytes + 4)
    with pytest.raises(ValueError, match=r"260 B but its slice and dtype make 256 B"):
        mutate(plan, pieces=tuple(pieces)).validate()
    pieces[0] = dataclasses.replace(plan.pieces[0], src_slice=((0, 9), (0, 16)))
    with pytest.raises(ValueError, match=r"source slice \(\(0, 9\), \(0, 16\)\) is not inside"):
        mutate(plan, pieces=tuple(pieces)).validate()
    pieces[0] = dataclasses.replace(plan.pieces[0], dst_dtype="int32")
    with pytest.raises(ValueError, match=r"dtype of the piece \(int32\) differs"):
        mutate(plan, pieces=tuple(pieces)).validate()


def test_validate_catches_overlapping_engine_tensors():
    tm, engines, pieces = synthetic()
    e = engines[0]
    moved = dataclasses.replace(e.tensors[1], offset=2 * ROW)  # E overlaps A
    engines[0] = dataclasses.replace(e, tensors=(e.tensors[0], moved))
    plan = build_plan(tm, engines, pieces, split=row_split)
    with pytest.raises(ValueError, match="rank 0 tensor E overlaps engine0 rank 0 tensor A"):
        plan.validate()
