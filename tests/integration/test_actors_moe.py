"""MoE end to end (tiny Qwen3-MoE, stacked experts) on local Ray: 4 trainers -> 2 replicas x TP2.

The stacked experts live on the cluster's (ep, dp_shard_in_ep) mesh as 2-D
DTensors; one optimizer step over the four ranks equals the same step taken by
one process on the whole batch; updates land byte-exact and generations match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from actors import (
    DemoActorConfig,
    TransferConfig,
    WeightTransferController,
    launch_engines,
    launch_trainers,
)
from actors.ready.trainer_model import make_optimizer, sequence_loss
from actors.tools.testkit.engine_bytes import engine_mismatches
from weight_transfer.engines.reference.hf_model import build_hf_model
from weight_transfer.types import Placement

DEMO = DemoActorConfig()  # what launch_trainers builds the trainers' model with

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS = [[1, 5, 9, 200, 33], [400, 2, 2, 81, 16]]


@pytest.fixture(scope="module")
def env(ray_job):  # a Ray job of its own on the shared cluster
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_moe.yaml",
                                    CONFIGS / "clusters" / "local_cpu.yaml")
    trainers, replicas = launch_trainers(cfg), launch_engines(cfg)
    yield cfg, trainers, replicas


def test_stacked_experts_live_on_the_cluster_expert_mesh(env):
    cfg, trainers, _ = env
    metas = ray.get([t.wt_param_metas.remote() for t in trainers])
    assert {m.expert_naming for m in metas} == {"stacked"}
    mesh, placements = cfg.cluster.stacked_expert_mesh()
    experts = [p for p in metas[0].params if ".mlp.experts." in p.name]
    assert experts and all(p.mesh.ranks == mesh.ranks and p.mesh.shape == mesh.shape
                           and p.placements == placements for p in experts)
    dense = [p for p in metas[0].params if ".mlp.experts." not in p.name]
    assert all(p.mesh.ranks == (0, 1, 2, 3) and p.placements == (Placement(kind="shard", dim=0),)
               for p in dense)


def test_one_step_over_four_ranks_equals_one_process(env):
    cfg, trainers, _ = env
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 12),
                           generator=torch.Generator().manual_seed(3))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    got = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    initial = build_hf_model(cfg.model, seed=DEMO.seed).state_dict()
    ref = build_hf_model(cfg.model, seed=DEMO.seed)
    opt = make_optimizer(ref, lr=DEMO.lr)
    ref.train()
    sequence_loss(ref(input_ids=tokens, use_cache=False).logits, tokens, prompt_len=0,
                  weights=None).backward()
    opt.step()
    want = ref.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        off = ((got[name].float() - w.float()).abs() > 0.5 * DEMO.lr).float().mean().item()
        moved = (got[name] != initial[name]).float().mean().item()
        # AdamW's first step moves each weight by about lr * sign(grad): the sharded step
        # must agree with the one-process step except where a gradient is ~0 (sign noise).
        assert off < 0.01, name
        if ".mlp.experts." in name or name.endswith("q_proj.weight"):
            assert moved > 0.5, name  # the step really changed these weights


@pytest.mark.parametrize("gather", ["shard_direct", "full"])
def test_updates_land_exact_bytes_and_generations(env, gather):
    """EP x FSDP stacked experts: the same bytes land gathering every parameter or writing
    shard-direct pieces (the experts' (Shard(0), Shard(1)) blocks cut per expert)."""
    cfg, trainers, replicas = env
    ctl = WeightTransferController(trainers=trainers, engines=replicas,
                                   config=cfg.replace(gather=gather))
    summary = ctl.setup()
    assert summary.expert_naming == "stacked"
    assert (summary.direct_bytes > 0) == (gather == "shard_direct")
    for version in (1, 2):
        tokens = torch.randint(0, cfg.model.vocab_size, (4, 12),
                               generator=torch.Generator().manual_seed(
                                   10 + version + 10 * (gather == "full")))
        ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
        assert ctl.update(version).bytes == summary.bytes_total
        assert engine_mismatches(cfg.model, trainers, replicas) == []
        want = ray.get([t.reference_generate.remote(PROMPTS, 5) for t in trainers])[0]
        assert [ray.get([a.generate.remote(PROMPTS, 5) for a in rep])[0]
                for rep in replicas] == [want, want]
    assert ctl.weights_version() == {"engine0": 2, "engine1": 2}
