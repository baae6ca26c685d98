"""Coalesced gathers on N-D meshes equal ``full_tensor()`` bit for bit, one collective per
sharded mesh dim per bucket.

Four gloo processes; each case distributes seeded tensors over a mesh with
``distribute_tensor`` (``torch.chunk`` per mesh dim, so uneven chunks and ranks
with zero rows), then every rank gathers the buckets the metadata cuts and,
for comparison, each parameter with ``full_tensor()``. The layouts: EP x FSDP
stacked experts (``(Shard(0), Shard(1))`` on ``(ep, dp_shard_in_ep)``, also
on the strided rank layout), HSDP (``(Replicate(), Shard(0))``), ``Shard(1)``
on a 1-D mesh, the same tensor dim sharded twice, and a 3-D mesh.
"""

from __future__ import annotations

import pytest
import torch
from gather_worker import run_rank  # tests/integration is on sys.path

from actors.tools.testkit.source_fleet import spawned_ranks
from weight_transfer.sender.buckets import plan_buckets, shard_levels
from weight_transfer.sender.gather_nd import level_shapes
from weight_transfer.types import MeshDesc, ParamMeta, Placement, numel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
WORLD = 4
S0, S1, R = ("shard", 0), ("shard", 1), ("replicate",)
EXPERTS = [("l0_gate_up_proj", (3, 7, 4), "bfloat16"), ("l0_down_proj", (3, 4, 5), "bfloat16"),
           ("l1_gate_up_proj", (1, 1, 3), "float32"), ("l1_down_proj", (4, 5, 2), "float32")]
CASES = {
    "ep_x_fsdp": ((2, 2), ("ep", "dp_shard_in_ep"), None, [S0, S1], EXPERTS, 1 << 20),
    "ep_x_fsdp_strided": ((2, 2), ("ep", "dp_shard_in_ep"), [0, 2, 1, 3], [S0, S1], EXPERTS,
                          1 << 20),
    "hsdp": ((2, 2), ("dp_replicate", "dp_shard"), None, [R, S0],
             [("wq", (5, 3), "float32"), ("norm", (7,), "float32"),
              ("emb", (6, 4), "bfloat16"), ("bias", (1, 4), "bfloat16")], 1 << 20),
    "shard1_1d": ((4,), ("dp",), None, [S1],
                  [("a", (3, 6), "float32"), ("b", (2, 3), "bfloat16")], 1 << 20),
    "dim0_twice": ((2, 2), ("a", "b"), None, [S0, S0],
                   [("x", (7, 3), "float32"), ("y", (3,), "bfloat16")], 1 << 20),
    "mesh_3d": ((2, 1, 2), ("x", "y", "z"), None, [S1, R, S0],
                [("p", (5, 3, 2), "float32"), ("q", (3, 5), "bfloat16")], 1 << 20),
    # a small bucket cap: the experts in several buckets, two collectives each
    "ep_x_fsdp_small_buckets": ((2, 2), ("ep", "dp_shard_in_ep"), None, [S0, S1], EXPERTS, 600),
}


@pytest.fixture(scope="module")
def results():
    with spawned_ranks(run_rank, WORLD, list(CASES.values()), what="gather rank") as out:
        yield [dict(zip(CASES, got, strict=True)) for got in out]


@pytest.mark.parametrize("case", list(CASES))
def test_bucketed_gather_equals_full_tensor_bit_for_bit(results, case):
    for rank, per_case in enumerate(results):
        got = per_case[case]
        assert all(got["coalesced"]), (rank, got["buckets"])
        assert set(got["bucketed"]) == set(got["reference"])
        for name, (dtype, shape, raw) in got["reference"].items():
            assert got["bucketed"][name][:2] == (dtype, shape), (rank, name)
            assert len(raw) == numel(shape) * torch.tensor([], dtype=getattr(
                torch, dtype.removeprefix("torch."))).element_size()
            assert got["bucketed"][name][2] == raw, (rank, name)


@pytest.mark.parametrize("case", list(CASES))
def test_one_collective_per_shard_dim_per_bucket_same_on_every_rank(results, case):
    *_, placements, params, bucket_bytes = CASES[case]
    dims = [k for k, p in enumerate(placements) if p[0] == "shard"][::-1]  # innermost first
    metas = results[0][case]["metas"]
    want_buckets = [[m.name for m in b.params] for b in plan_buckets(metas,
                                                                     bucket_bytes=bucket_bytes)]
    want = [("all_gather", tuple(b), k) for b in want_buckets for k in dims]
    for rank, per_case in enumerate(results):
        got = per_case[case]
        assert got["buckets"] == want_buckets, rank
        assert [(c[0], c[1], c[3]) for c in got["record"]] == want, rank
    assert len(want) < len(dims) * len(params) or len(want_buckets) == len(params)
    if case == "ep_x_fsdp_small_buckets":
        assert 1 < len(want_buckets) < len(params)


@pytest.mark.parametrize("case", ["ep_x_fsdp", "ep_x_fsdp_strided", "hsdp", "shard1_1d"])
def test_cases_hold_uneven_chunks_and_empty_shards(results, case):
    # guards the cases' intent: some rank holds fewer rows than another, some none
    meta = results[0][case]["metas"]
    local = [[level_shapes(m.shape, shard_levels(m), r[case]["coordinate"])[-1] for m in meta]
             for r in results]
    assert any(0 in s for rank in local for s in rank), case
    assert len({tuple(rank) for rank in local}) > 1, case


def test_hsdp_metadata_and_placements_come_from_the_live_dtensors(results):
    m = results[0]["hsdp"]["metas"][0]
    assert m.mesh == MeshDesc(ranks=(0, 1, 2, 3), shape=(2, 2),
                              dim_names=("dp_replicate", "dp_shard"))
    assert m.placements == (Placement(kind="replicate"), Placement(kind="shard", dim=0))
    assert isinstance(m, ParamMeta)
