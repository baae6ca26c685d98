"""The controller over our authenticated ``tcp`` transport, with the reference engine.

Setup gives every engine NIC the regions each trainer NIC may write (from the
plan) and every trainer NIC a fresh link key; updates then land byte-exact (every
engine byte equals the reference layout of the trainers' weights), nothing is
refused, and a new replica is filled from a peer over engine-to-engine links.
Between updates (engines serving, window closed) a write by a planned writer is
refused with nothing written; the refusal is counted on the engine and the next
update's audit line names the engine rank that refused it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import ray
import torch

from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
from actors.audit import read_audit
from actors.testing.engine_bytes import engine_mismatches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def local_ray(ray_job):  # a Ray job of its own on the shared cluster (on LOCAL_NODE_IP)
    yield


def _stats(replicas):
    return [ray.get(a.wt_nic_stats.remote()) for rep in replicas for a in rep]


def test_setup_and_updates_over_tcp_are_byte_exact(local_ray):
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    CONFIGS / "clusters" / "local_cpu.yaml",
                                    transport="tcp",
                                    transport_options={"encrypt": True, "chunk_bytes": 1 << 16})
    trainers = launch_trainers(cfg)
    replicas = launch_engines(cfg)
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    summary = ctl.setup()
    assert all(summary.regions_by_rank[r] for r in range(len(trainers)))
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(3))
    for version in (1, 2):
        ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
        assert ctl.update(version).bytes == summary.bytes_total
        assert engine_mismatches(cfg.model, trainers, replicas) == []
    assert ray.get([a.wt_transport.remote() for rep in replicas for a in rep]) == ["tcp"] * 4
    assert all(s["refused_writes"] == 0 and s["refused_connections"] == 0
               for s in _stats(replicas))
    (new,) = launch_engines(cfg, replicas=[2])
    assert ctl.add_replica(new) == "engine2"
    assert engine_mismatches(cfg.model, trainers, [new]) == []  # copied from a peer over tcp
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    assert ctl.update(3).bytes == summary.bytes_total * 3 // 2
    assert engine_mismatches(cfg.model, trainers, [*replicas, new]) == []
    ctl.shutdown()


def test_a_planned_writer_cannot_write_while_the_engine_serves(local_ray, tmp_path):
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    CONFIGS / "clusters" / "local_cpu.yaml", transport="tcp",
                                    audit_path=str(tmp_path / "audit.jsonl"))
    trainers = launch_trainers(cfg)
    replicas = launch_engines(cfg)
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    ray.get([t.train_step.remote([[1, 2, 3, 4]]) for t in trainers])
    ctl.update(1)
    before = engine_mismatches(cfg.model, trainers, replicas)
    assert before == []
    owner, nic, addr = ctl.summary.regions_by_rank[0][0]  # a region rank 0 may write
    metas = [ray.get(a.wt_engine_meta.remote()) for rep in replicas for a in rep]
    region = next(t.region for m in metas for t in m.tensors if t.region.addr == addr
                  and (t.region.owner, t.region.nic) == (owner, nic))
    target = next(i for i, m in enumerate(metas) if any(t.region == region for t in m.tensors))

    def raw_write(actor, region):  # on trainer rank 0, a planned writer with its link key
        asyncio.run(actor._wt_link.nic.write(bytes(64), region, 0))

    with pytest.raises(ray.exceptions.RayTaskError, match="outside an update window"):
        ray.get(trainers[0].__ray_call__.remote(raw_write, region))
    assert engine_mismatches(cfg.model, trainers, replicas) == []  # nothing written
    assert _stats(replicas)[target]["refused_writes"] == 1
    ctl.update(2)  # the next audit line names the engine rank that refused it
    lines = read_audit(tmp_path / "audit.jsonl")
    assert lines[0]["refused"] == {} and lines[1]["outcome"] == "ok"
    rank = f"{metas[target].replica}/tp{metas[target].rank}"
    assert lines[1]["refused"] == {rank: {"connections": 0, "writes": 1}}
    ctl.shutdown()
