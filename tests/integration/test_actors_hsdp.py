"""HSDP end to end on local Ray: 4 trainers as (dp_replicate=2, dp_shard=2) -> 2 replicas x TP2.

The cluster ``local_cpu_hsdp`` sets ``trainer.replicate: 2``: the trainer actors
shard dense parameters with ``fully_shard`` over the 2-D mesh (HSDP, placements
``(Replicate(), Shard(0))``); the MoE model's stacked experts stay on
``(ep, dp_shard_in_ep)`` as ``(Shard(0), Shard(1))``. Both layouts go through the
whole actor path (live metadata -> plan -> executor's coalesced N-D gathers), and
after a real optimizer step every engine byte equals the reference loader's
layout of the trainer's weights. The MoE model covers both layouts (its dense
parameters are on the HSDP mesh), so one fleet is started, not two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
from actors.tools.testkit.engine_bytes import engine_mismatches
from scheduling.config_metadata import trainer_meta_from_config
from weight_transfer.types import Placement

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HSDP = (Placement(kind="replicate"), Placement(kind="shard", dim=0))


@pytest.fixture(scope="module", params=["tiny_moe"])  # its dense params are HSDP too
def env(request, ray_job):  # a Ray job of its own on the shared cluster
    cfg = TransferConfig.from_files(CONFIGS / "models" / f"{request.param}.yaml",
                                    CONFIGS / "clusters" / "local_cpu_hsdp.yaml",
                                    update_timeout_s=240, barrier_timeout_s=120)
    yield cfg, launch_trainers(cfg), launch_engines(cfg)


def test_dense_parameters_live_on_the_hsdp_mesh(env):
    cfg, trainers, _ = env
    metas = ray.get(trainers[0].wt_param_metas.remote()).params
    dense = [p for p in metas if ".mlp.experts." not in p.name]
    assert dense and all(p.mesh == cfg.cluster.dense_mesh() and p.placements == HSDP
                         for p in dense)
    assert cfg.cluster.dense_mesh().dim_names == ("dp_replicate", "dp_shard")
    planned = {m.name: m for m in trainer_meta_from_config(
        cfg.model, cfg.cluster, expert_naming="stacked" if cfg.model.n_experts else
        "per_expert").params}
    for p in metas:  # what the config predicts is what the live model holds
        q = planned[p.name]
        assert (p.shape, p.dtype, p.mesh.ranks, p.mesh.shape, p.placements) == (
            q.shape, q.dtype, q.mesh.ranks, q.mesh.shape, q.placements), p.name


@pytest.mark.parametrize("gather", ["full", "shard_direct"])
def test_update_after_a_step_lands_the_reference_bytes(env, gather):
    cfg, trainers, replicas = env
    ctl = WeightTransferController(trainers=trainers, engines=replicas,
                                   config=cfg.replace(gather=gather))
    summary = ctl.setup()
    assert (summary.direct_bytes > 0) == (gather == "shard_direct")
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 12),
                           generator=torch.Generator().manual_seed(5 + (gather == "full")))
    losses = ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    assert len(set(losses)) == 1
    report = ctl.update(1, trace=True)
    assert report.bytes == summary.bytes_total
    if gather == "full":  # coalesced buckets ran: an item holds several parameters ("(+n)")
        assert any("(+" in s.key for r in report.trace.ranks for s in r.spans)
    assert engine_mismatches(cfg.model, trainers, replicas) == []
    assert ctl.weights_version() == {"engine0": 1, "engine1": 1}
