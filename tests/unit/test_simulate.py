"""The discrete-event model: hand-computed times for small plans, bounds on random ones."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling import compute_plan, simulate
from scheduling.cluster.config import cluster_from_dict, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scheduling.plan import Plan
from weight_transfer.model.models import load_model_config
from weight_transfer.types import (
    EngineRankMeta,
    MeshDesc,
    ParamMeta,
    Piece,
    Placement,
    RankInfo,
    RegionDesc,
    ShardSpec,
)

ROOT = Path(__file__).resolve().parents[2]
GB = 10**9


def sim_cluster(send_gbps=8.0, recv_gbps=8.0, inflight=8, latency_us=0.0):
    """8 Gb/s = 1e9 B/s, so bytes / 1e9 are seconds."""
    return cluster_from_dict({
        "name": "sim",
        "trainer": {"nodes": 1, "gpus_per_node": 1, "nics_per_node": 1, "nic_gbps": send_gbps},
        "inference": {"replicas": 1, "gpus_per_replica": 1, "tensor_parallel": 1,
                      "nics_per_node": 1, "nic_gbps": recv_gbps},
        "sim": {"max_inflight": inflight, "write_latency_us": latency_us},
    })


def toy_plan(tasks, n_src, n_dst, groups=1):
    """A plan from (src, dst, nbytes, group) rows: sender r uses NIC "s<r>", engine d "r<d>"."""
    tasks = sorted(tasks, key=lambda t: (t[0], t[3]))  # plan order: by source, then group
    mesh = MeshDesc(ranks=tuple(range(n_src)), shape=(n_src,))
    pieces = tuple(Piece(dst_tensor="t", dst_offset=0, nbytes=n, dst_dtype="uint8",
                         src_param="p", src_slice=((0, n),)) for _, _, n, _ in tasks)
    regions = tuple(RegionDesc(owner=f"r{d}", nic=f"r{d}", addr=1, length=1, rkey=1)
                    for d in range(n_dst))
    src = np.array([t[0] for t in tasks], dtype=np.int32)
    return Plan(
        params=(ParamMeta(name="p", shape=(1,), dtype="uint8", mesh=mesh),),
        trainer_ranks=tuple(RankInfo(rank=r, node="n", nic=f"s{r}") for r in range(n_src)),
        engines=tuple(EngineRankMeta(replica=f"r{d}", rank=0, node="m", nic=f"r{d}",
                                     shard=ShardSpec(), tensors=()) for d in range(n_dst)),
        pieces=pieces, regions=regions,
        send_nics=tuple(f"s{r}" for r in range(n_src)),
        recv_nics=tuple(f"r{d}" for d in range(n_dst)),
        meshes=(mesh,), mesh_group=(0,), param_mesh=(0,),
        group_params=tuple(() for _ in range(groups)),
        task_piece=np.arange(len(tasks), dtype=np.int32), task_src=src,
        task_dst=np.array([t[1] for t in tasks], dtype=np.int32),
        task_region=np.array([t[1] for t in tasks], dtype=np.int32),
        task_offset=np.zeros(len(tasks), dtype=np.int64),
        task_group=np.array([t[3] for t in tasks], dtype=np.int16),
        trainer_ptr=np.searchsorted(src, np.arange(n_src + 1)),
    )


@pytest.mark.parametrize(
    ("tasks", "n_src", "n_dst", "cluster_kw", "seconds", "bound"),
    [
        # one write at line rate
        ([(0, 0, GB, 0)], 1, 1, {}, 1.0, 1.0),
        # one sender, two receivers: the sender is the bottleneck
        ([(0, 0, GB, 0), (0, 1, GB, 0)], 1, 2, {}, 2.0, 2.0),
        ([(0, 0, GB, 0), (0, 1, GB, 0)], 1, 2, {"inflight": 1}, 2.0, 2.0),
        # two senders, one receiver: the receiver is
        ([(0, 0, GB, 0), (1, 0, GB, 0)], 2, 1, {}, 2.0, 2.0),
        # disjoint pairs run in parallel
        ([(0, 0, GB, 0), (1, 1, GB, 0)], 2, 2, {}, 1.0, 1.0),
        # a slow receiver (0.5 GB/s): one at a time takes 4 s, two in flight 2 s
        ([(0, 0, GB, 0), (0, 1, GB, 0)], 1, 2, {"recv_gbps": 4, "inflight": 1}, 4.0, 2.0),
        ([(0, 0, GB, 0), (0, 1, GB, 0)], 1, 2, {"recv_gbps": 4, "inflight": 2}, 2.0, 2.0),
        # per-write overhead: 1 s of sender time each
        ([(0, 0, GB, 0)], 1, 1, {"latency_us": 1e6}, 2.0, 1.0),
        # unequal sizes share the sender until the small one ends: 0.5 GB each for 1 s, ...
        ([(0, 0, GB // 2, 0), (0, 1, GB, 0)], 1, 2, {}, 1.5, 1.5),
    ],
)
def test_hand_computed_times(tasks, n_src, n_dst, cluster_kw, seconds, bound):
    r = simulate(toy_plan(tasks, n_src, n_dst), sim_cluster(**cluster_kw), resolution=0)
    assert r.seconds == pytest.approx(seconds, rel=1e-9)
    assert r.lower_bound_seconds == pytest.approx(bound, rel=1e-9)
    assert r.seconds >= r.lower_bound_seconds * (1 - 1e-12)


def test_barrier_between_groups_serializes_them():
    plan = toy_plan([(0, 0, GB, 0), (1, 1, GB, 1)], 2, 2, groups=2)
    r = simulate(plan, sim_cluster(), resolution=0)
    assert r.group_seconds == pytest.approx((1.0, 1.0))
    assert r.seconds == pytest.approx(2.0)
    assert r.lower_bound_seconds == pytest.approx(1.0)  # every NIC moves 1 GB in all
    assert r.barrier_lower_bound_seconds == pytest.approx(2.0)


def test_max_min_fairness_hands_unused_capacity_on():
    # A sends to R0 and R1; B and C send to R0. R0 is shared three ways (1/3 each), so A's
    # write to R1 can take the 2/3 of A that is left, not just A's even half.
    tasks = [(0, 0, GB, 0), (0, 1, GB, 0), (1, 0, GB, 0), (2, 0, GB, 0)]
    plan = toy_plan(tasks, 3, 2)
    fair = simulate(plan, sim_cluster(), resolution=0, fill_rounds=4)
    even = simulate(plan, sim_cluster(), resolution=0, fill_rounds=1)
    assert fair.per_nic_busy_seconds["r1"] == pytest.approx(1.5)
    assert even.per_nic_busy_seconds["r1"] == pytest.approx(2.0)
    assert fair.seconds == pytest.approx(3.0) and even.seconds == pytest.approx(3.0)
    assert fair.per_nic_busy_seconds["r0"] == pytest.approx(3.0)


def test_bad_arguments():
    plan = toy_plan([(0, 0, 1, 0)], 1, 1)
    with pytest.raises(ValueError, match="max_inflight and fill_rounds"):
        simulate(plan, sim_cluster(), fill_rounds=0)


@settings(max_examples=40, deadline=None)
@given(
    tasks=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 10**8), st.integers(0, 1)),
        min_size=1, max_size=40,
    ),
    inflight=st.integers(1, 4),
    recv_gbps=st.sampled_from([4.0, 8.0, 16.0]),
)
def test_prediction_lies_between_bounds(tasks, inflight, recv_gbps):
    plan = toy_plan(tasks, 4, 3, groups=2)
    cl = sim_cluster(recv_gbps=recv_gbps, inflight=inflight)
    r = simulate(plan, cl, resolution=0)
    # never faster than the busiest NIC of each group allows ...
    assert r.seconds >= r.barrier_lower_bound_seconds * (1 - 1e-9)
    # ... never slower than every write alone at the slower line rate, one after another
    slowest = min(cl.send_bytes_per_s, cl.recv_bytes_per_s)
    assert r.seconds <= sum(t[2] for t in tasks) / slowest * (1 + 1e-9)
    assert max(r.per_nic_busy_seconds.values()) <= r.seconds * (1 + 1e-9)
    coarse = simulate(plan, cl, resolution=1e-3)
    assert coarse.seconds >= r.barrier_lower_bound_seconds * (1 - 1e-9)


def test_tiny_model_plan_runs_near_its_bound():
    cfg = load_model_config(ROOT / "configs/models/tiny_moe.yaml")
    cl = load_cluster_config(ROOT / "configs/clusters/local_cpu.yaml")
    plan = compute_plan(trainer_meta_from_config(cfg, cl), engine_metas_from_config(cfg, cl),
                        cl, model=cfg)
    exact = simulate(plan, cl, resolution=0)
    coarse = simulate(plan, cl)
    assert exact.seconds >= exact.barrier_lower_bound_seconds * (1 - 1e-9)
    assert exact.efficiency > 0.5
    # coarse completion windows change the prediction by little
    assert coarse.seconds == pytest.approx(exact.seconds, rel=0.01)
    assert set(exact.per_nic_busy_seconds) == set(plan.send_nics) | set(plan.recv_nics)


def stage_cluster(**sim):
    c = sim_cluster()
    return c.model_copy(update={"sim": c.sim.model_copy(update=sim)})


@pytest.mark.parametrize(("groups", "sim", "seconds"), [
    # a barrier between two groups: each takes its write, 1 s
    (2, {}, 2.0),
    # copies at 1 GB/s before each write: 1 + 1 per group
    (2, {"copy_gbps": 1.0}, 4.0),
    (1, {"copy_gbps": 2.0}, 1.5),
    # a fixed 0.5 s per parameter before its write: 0.5 + 1 per group
    (1, {"param_overhead_us": 5e5}, 1.5),
    (2, {"param_overhead_us": 5e5}, 3.0),
    # a fixed 0.25 s of sender CPU per write, on top of its 1 s of bytes
    (1, {"write_overhead_us": 2.5e5}, 1.25),
    # both, and a copy: 0.5 (param) + 0.5 (copy at 2 GB/s) + 1 + 0.25 (write)
    (1, {"param_overhead_us": 5e5, "write_overhead_us": 2.5e5, "copy_gbps": 2.0}, 2.25),
])
def test_full_model_on_toy_plans(groups, sim, seconds):
    rows = [(0, 0, GB, g) for g in range(groups)]
    r = simulate(toy_plan(rows, 1, 1, groups=groups), stage_cluster(**sim), resolution=0)
    assert r.seconds == pytest.approx(seconds)
    assert r.seconds >= r.lower_bound_seconds
    assert r.nic_seconds == pytest.approx(groups * 1.0)


@pytest.mark.parametrize("nic_model", ["events", "bound"])
def test_write_overhead_is_paid_per_write_and_param_overhead_per_parameter(nic_model):
    # one parameter, four writes of 1/4 GB: 1 s of bytes + 4 x 0.1 s + 0.3 s once
    rows = [(0, 0, GB // 4, 0)] * 4
    cl = stage_cluster(write_overhead_us=1e5, param_overhead_us=3e5)
    r = simulate(toy_plan(rows, 1, 1), cl, resolution=0, nic_model=nic_model)
    assert r.seconds == pytest.approx(1.7)


def test_nic_bound_is_a_lower_bound_of_the_full_prediction():
    cfg = load_model_config(ROOT / "configs/models/tiny_moe.yaml")
    cl = load_cluster_config(ROOT / "configs/clusters/local_cpu.yaml")
    cl = cl.model_copy(update={"sim": cl.sim.model_copy(update={
        "intra_node_gbps": 0.5, "gather_latency_us": 100, "copy_gbps": 1.0,
        "fp8_quant_gbps": 0.2, "h2d_gbps": 2.0, "watermark_bytes": 1 << 20})})
    plan = compute_plan(trainer_meta_from_config(cfg, cl),
                        engine_metas_from_config(cfg, cl, fp8=True), cl, model=cfg, fp8=True)
    for model in ("events", "bound"):
        r = simulate(plan, cl, nic_model=model, record=True)
        assert r.seconds >= r.barrier_lower_bound_seconds >= r.lower_bound_seconds * (1 - 1e-9)
        assert set(r.stage_seconds) == {"h2d", "gather", "prepare", "write"}
        assert (r.task_end >= r.task_start).all()


@pytest.mark.parametrize(("sim", "seconds", "binding"), [
    # two ranks each copy 1 GB at 1 GB/s, then write 1 GB (1 s): 2 s each on its own device
    ({"copy_gbps": 1.0}, 2.0, None),
    # the same on one shared core: 2 s of copies, sequential, and the last write after it
    ({"copy_gbps": 1.0, "cpu_cores": 1}, 2.0, None),
    # ... plus the sender copying every written byte at 1 GB/s: 4 s of CPU on one core
    ({"copy_gbps": 1.0, "cpu_cores": 1, "write_copy_gbps": 1.0}, 4.0, "cpu"),
    # two cores share it: 2 s, no more than each rank's own 2 s
    ({"copy_gbps": 1.0, "cpu_cores": 2, "write_copy_gbps": 1.0}, 2.0, None),
    # half a core: 4 s of prepare alone (writes' copies not charged)
    ({"copy_gbps": 1.0, "cpu_cores": 0.5}, 4.0, "cpu"),
])
def test_cpu_work_of_all_ranks_shares_the_cores(sim, seconds, binding):
    rows = [(0, 0, GB, 0), (1, 1, GB, 0)]
    r = simulate(toy_plan(rows, 2, 2), stage_cluster(**sim), resolution=0)
    assert r.seconds == pytest.approx(seconds)
    assert (r.binding == "cpu") == (binding == "cpu")


def two_param_plan(placement_shard: bool) -> Plan:
    """Two parameters of 1 kB on one 1-D mesh of 2 ranks, each written once by rank 0."""
    mesh = MeshDesc(ranks=(0, 1), shape=(2,))
    pl = (Placement(kind="shard", dim=0),) if placement_shard else (Placement(kind="replicate"),)
    params = tuple(ParamMeta(name=n, shape=(1000,), dtype="uint8", mesh=mesh, placements=pl)
                   for n in ("a", "b"))
    pieces = tuple(Piece(dst_tensor="t", dst_offset=1000 * i, nbytes=1000, dst_dtype="uint8",
                         src_param=n, src_slice=((0, 1000),)) for i, n in enumerate("ab"))
    return Plan(
        params=params,
        trainer_ranks=(RankInfo(rank=0, node="n", nic="s0"), RankInfo(rank=1, node="n", nic="s1")),
        engines=(EngineRankMeta(replica="r0", rank=0, node="m", nic="r0", shard=ShardSpec(),
                                tensors=()),),
        pieces=pieces, regions=(RegionDesc(owner="r0", nic="r0", addr=1, length=1, rkey=1),),
        send_nics=("s0", "s1"), recv_nics=("r0",), meshes=(mesh,), mesh_group=(0,),
        param_mesh=(0, 0), group_params=((0, 1),),
        task_piece=np.arange(2, dtype=np.int32), task_src=np.zeros(2, dtype=np.int32),
        task_dst=np.zeros(2, dtype=np.int32), task_region=np.zeros(2, dtype=np.int32),
        task_offset=np.array([0, 1000]), task_group=np.zeros(2, dtype=np.int16),
        trainer_ptr=np.array([0, 2, 2]),
    )


@pytest.mark.parametrize(("shard", "mode", "seconds"), [
    (True, "bucket", 1.0),  # FSDP2 parameters next to each other: one all-gather, one hop
    (True, "param", 2.0),  # one gather per parameter: a hop each
    (False, "bucket", 0.0),  # replicated: nothing to gather
])
def test_pipeline_items_are_the_executors_gather_buckets(shard, mode, seconds):
    # writes are free (1 kB at 8 GB/s); one ring hop of a gather costs 1 s
    cl = stage_cluster(intra_node_gbps=1000.0, gather_latency_us=1e6, gather_mode=mode)
    r = simulate(two_param_plan(shard), cl, resolution=0)
    assert r.seconds == pytest.approx(seconds, abs=1e-3)


def test_each_group_names_the_stage_that_binds_it():
    # group 0: one 1 GB write (1 + 0.2 s) after 1.5 s of parameter overhead: prepare binds;
    # group 1: ten 0.1 GB writes, 1 + 10 x 0.2 s of writing after the same 1.5 s: write binds
    rows = [(0, 0, GB, 0)] + [(0, 0, GB // 10, 1)] * 10
    cl = stage_cluster(param_overhead_us=1.5e6, write_overhead_us=2e5)
    r = simulate(toy_plan(rows, 1, 1, groups=2), cl, resolution=0)
    assert r.group_binding == ("prepare", "write")
    assert r.group_seconds == pytest.approx((2.7, 4.5))
    assert r.binding == "write"  # 3.2 s of writes against 3.0 s of prepare on the rank
    shared = simulate(toy_plan(rows, 1, 1, groups=2), stage_cluster(
        param_overhead_us=1.5e6, write_overhead_us=2e5, cpu_cores=0.1), resolution=0)
    assert shared.group_binding == ("cpu", "cpu")
