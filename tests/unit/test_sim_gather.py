"""Gather costs of 1-D and N-D meshes: one ring per Shard mesh dim over that dim's group."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from scheduling import compute_plan, simulate
from scheduling.cluster.config import cluster_from_dict
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scheduling.sim.gather import gather_rings, param_gathers, sharded_fraction
from scheduling.sim.stages import _item_gathers
from weight_transfer.model.models import load_model_config
from weight_transfer.sender.buckets import plan_buckets
from weight_transfer.types import MeshDesc, ParamMeta, Placement, RankInfo

ROOT = Path(__file__).resolve().parents[2]
S0, S1, R = Placement(kind="shard", dim=0), Placement(kind="shard", dim=1), \
    Placement(kind="replicate")
NODE_OF_4 = {r: f"n{r // 4}" for r in range(8)}  # 2 nodes x 4 ranks


def mesh(shape, ranks=None):
    n = int(np.prod(shape))
    return MeshDesc(ranks=tuple(range(n)) if ranks is None else ranks, shape=shape)


@pytest.mark.parametrize(("m", "placements", "rings", "fraction"), [
    (mesh((8,)), (S0,), [(0, 8, False)], 1 / 8),  # FSDP over both nodes
    (mesh((2, 4)), (R, S0), [(1, 4, True)], 1 / 4),  # HSDP: a replica group per node
    (mesh((4, 2)), (R, S0), [(1, 2, True)], 1 / 2),
    (mesh((2, 4)), (S0, R), [(0, 2, False)], 1 / 2),  # sharded across the nodes
    (mesh((2, 4)), (R, R), [], 1.0),
    (mesh((2, 4)), (S0, S1), [(1, 4, True), (0, 2, False)], 1 / 8),  # innermost first
    # strided EP x FSDP (torchtitan): rows are ranks {0,2,4,6}, {1,3,5,7}
    (mesh((2, 4), (0, 2, 4, 6, 1, 3, 5, 7)), (S0, S1), [(1, 4, False), (0, 2, True)], 1 / 8),
    (mesh((1, 8)), (S0, S0), [(1, 8, False)], 1 / 8),  # a dim of 1 gathers nothing
])
def test_rings_per_shard_dim(m, placements, rings, fraction):
    assert gather_rings(m, placements, NODE_OF_4) == rings
    assert sharded_fraction(m, placements) == pytest.approx(fraction)


def test_placements_must_match_the_mesh_dims():
    with pytest.raises(ValueError, match=r"1 placements for a mesh of 2 dims \(2, 4\)"):
        gather_rings(mesh((2, 4)), (S0,), NODE_OF_4)
    p = ParamMeta(name="w", shape=(8,), dtype="uint8", mesh=mesh((2, 4)), placements=(S0,))
    plan = SimpleNamespace(params=(p,), trainer_ranks=tuple(
        RankInfo(rank=r, node=NODE_OF_4[r], nic="x") for r in range(8)))
    with pytest.raises(ValueError, match=r"parameter 'w': 1 placements for a mesh of 2 dims"):
        param_gathers(plan, _cluster())


def _cluster(**sim):
    return cluster_from_dict({
        "name": "g",
        "trainer": {"nodes": 2, "gpus_per_node": 4, "nics_per_node": 4, "nic_gbps": 80},
        "inference": {"replicas": 1, "gpus_per_replica": 2, "tensor_parallel": 2,
                      "nics_per_node": 2, "nic_gbps": 80},
        "sim": {"intra_node_gbps": 100.0, "inter_node_gbps": 10.0, **sim},
    })


GBYTE = 10**9
LAT = 5e-6


@pytest.mark.parametrize(("m", "placements", "seconds", "hops"), [
    # FSDP over 8 ranks on 2 nodes: the inter-node link, 10 GB/s
    (mesh((8,)), (S0,), 7 / 8 * 1.0 / 10 + 7 * LAT, 7),
    # HSDP 2 x 4: a ring over the 4 ranks of a node at 100 GB/s
    (mesh((2, 4)), (R, S0), 3 / 4 * 1.0 / 100 + 3 * LAT, 3),
    # Shard, Shard: 4 ranks in a node gather 1/2 of it, then 2 across nodes gather it all
    (mesh((2, 4)), (S0, S1), 3 / 4 * 0.5 / 100 + 1 / 2 * 1.0 / 10 + 4 * LAT, 4),
    (mesh((2, 4)), (R, R), 0.0, 0),
])
def test_param_gather_seconds(m, placements, seconds, hops):
    p = ParamMeta(name="w", shape=(GBYTE,), dtype="uint8", mesh=m, placements=placements)
    plan = SimpleNamespace(params=(p,), trainer_ranks=tuple(
        RankInfo(rank=r, node=NODE_OF_4[r], nic=f"{NODE_OF_4[r]}/nic{r % 4}") for r in range(8)))
    got, got_hops, held = param_gathers(plan, _cluster(gather_latency_us=LAT * 1e6))
    assert got[0] == pytest.approx(seconds)
    assert got_hops.tolist() == [hops]
    assert held[0] == pytest.approx(sharded_fraction(m, placements))
    off, off_hops, off_held = param_gathers(plan, _cluster(gathers=False))
    assert off.tolist() == [0.0] and off_hops.tolist() == [0]
    assert off_held.tolist() == held.tolist()  # h2d still moves only the shard


def test_a_coalesced_bucket_pays_one_gathers_hops():
    # items: {0, 1} coalesced (3 hops each), {2} alone; 1 s of bytes per param, 1 s per hop
    sim = SimpleNamespace(gather_latency_us=1e6)
    gathers = np.array([1.0 + 3, 1.0 + 3, 2.0 + 7])
    got = _item_gathers(gathers, np.array([3, 3, 7]), np.array([0, 0, 1]),
                        np.array([True, False]), sim)
    assert got.tolist() == [2.0 + 3, 2.0 + 7]


def _plan(replicate: int, **sim):
    cl = _cluster(gather_latency_us=LAT * 1e6, gather_mode="param", **sim)
    cl = cl.model_copy(update={"trainer": cl.trainer.model_copy(
        update={"replicate": replicate})})
    cfg = load_model_config(ROOT / "configs/models/tiny_llama.yaml")
    plan = compute_plan(trainer_meta_from_config(cfg, cl), engine_metas_from_config(cfg, cl),
                        cl, model=cfg, gather="full")  # these tests time the gathers
    return plan, cl


@pytest.mark.parametrize(("replicate", "ring", "bytes_per_s"), [
    (1, 8, 10 * GBYTE), (2, 4, 100 * GBYTE), (4, 2, 100 * GBYTE)])
def test_hsdp_gathers_run_over_a_replica_group(replicate, ring, bytes_per_s):
    plan, cl = _plan(replicate)
    r = simulate(plan, cl, nic_model="bound")
    nbytes = np.array([p.nbytes for p in plan.params], dtype=np.float64)
    # every rank gathers every dense parameter, one ring each (gather_mode="param")
    want = ((ring - 1) / ring * nbytes / bytes_per_s + (ring - 1) * LAT).sum()
    assert r.stage_seconds["gather"] == pytest.approx(want)
    assert r.seconds >= r.lower_bound_seconds


def test_hsdp_h2d_moves_the_replica_groups_shard():
    fsdp, cl = _plan(1, h2d_gbps=1.0)
    hsdp, _ = _plan(2, h2d_gbps=1.0)
    total = sum(p.nbytes for p in fsdp.params) / 1e9
    assert simulate(fsdp, cl, nic_model="bound").stage_seconds["h2d"] == pytest.approx(total / 8)
    cl2 = cl.model_copy(update={"trainer": cl.trainer.model_copy(update={"replicate": 2})})
    assert simulate(hsdp, cl2, nic_model="bound").stage_seconds["h2d"] == pytest.approx(total / 4)


@pytest.mark.parametrize("replicate", [1, 2])
def test_bucketed_gathers_pay_hops_once_per_collective_of_the_executors_buckets(replicate):
    plan, cl = _plan(replicate)
    cl = cl.model_copy(update={"sim": cl.sim.model_copy(update={"gather_mode": "bucket"})})
    cl = cl.model_copy(update={"trainer": cl.trainer.model_copy(update={"replicate": replicate})})
    ring, bw = (8, 10 * GBYTE) if replicate == 1 else (4, 100 * GBYTE)
    (order,) = plan.group_params  # tiny_llama: dense only, one group
    buckets = plan_buckets([plan.params[i] for i in order], mode="bucket",
                           bucket_bytes=min(cl.sim.bucket_bytes, cl.sim.watermark_bytes // 4))
    collectives = sum(1 if b.coalesced else len(b.params) for b in buckets)
    nbytes = sum(p.nbytes for p in plan.params)
    want = (ring - 1) / ring * nbytes / bw + (ring - 1) * LAT * collectives
    r = simulate(plan, cl, nic_model="bound")
    assert r.stage_seconds["gather"] == pytest.approx(want)
    if replicate == 1:  # FSDP2 buckets coalesce: fewer collectives than parameters
        assert collectives < len(plan.params)
