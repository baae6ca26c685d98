"""Executing the plan in memory lands exactly the bytes the reference loader computes.

For each case: build metadata from a model config and a cluster, compute and
validate the plan, send each trainer its (msgpack round-tripped) task list,
replay every task with ``prepare_piece`` into per-rank region buffers, and
compare every engine tensor byte for byte with ``load_engine_shard`` - an
independent, vLLM-style loader that shares no code with the layout.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actors.tools.testkit.replay import replay_in_memory
from scheduling import compute_plan
from scheduling.cluster.config import cluster_from_dict
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.models import ModelConfig, load_model_config
from weight_transfer.plan.wire import dumps_trainer_plan, loads_trainer_plan
from weight_transfer.sender.prepare import as_bytes

ROOT = Path(__file__).resolve().parents[2]


def model(name: str, **changes) -> ModelConfig:
    cfg = load_model_config(ROOT / "configs" / "models" / f"{name}.yaml")
    return cfg.model_copy(update=changes) if changes else cfg


def cluster(nodes=2, gpus=2, nics=2, ep=1, layout="strided", replicas=2, tp=2, iep=1, inodes=1,
            inics=2, fp8=False):
    return cluster_from_dict({
        "name": "test",
        "trainer": {"nodes": nodes, "gpus_per_node": gpus, "nics_per_node": nics,
                    "nic_gbps": 100, "expert_parallel": ep, "expert_mesh_layout": layout},
        "inference": {"replicas": replicas, "gpus_per_replica": tp, "tensor_parallel": tp,
                      "expert_parallel": iep, "nodes_per_replica": inodes,
                      "nics_per_node": inics, "nic_gbps": 100, "fp8": fp8},
    })


def run_and_compare(cfg, cl, *, expert_naming="per_expert", seed=0, **plan_kw):
    tm = trainer_meta_from_config(cfg, cl, expert_naming=expert_naming)
    em = engine_metas_from_config(cfg, cl)
    plan = compute_plan(tm, em, cl, model=cfg, expert_naming=expert_naming, **plan_kw)
    plan.validate()
    state = random_state_dict(cfg, seed=seed, expert_naming=expert_naming)
    received = [loads_trainer_plan(dumps_trainer_plan(plan.trainer_plan(r.rank)))
                for r in tm.ranks]
    got = replay_in_memory(plan, state, trainer_plans=received)
    fp8 = cl.inference.fp8
    reference = {}  # replicas share shards
    for e in em:
        if e.shard not in reference:
            reference[e.shard] = load_engine_shard(cfg, state, e.shard, fp8=fp8)
        want = reference[e.shard]
        tensors = got[(e.replica, e.rank)]
        assert set(tensors) == set(want), (e.replica, e.rank)
        for name, ref in want.items():
            assert torch.equal(tensors[name], as_bytes(ref)), (e.replica, e.rank, name)
    return plan


CASES = [
    ("tiny_llama", {}, {}),
    ("tiny_llama", {}, {"tp": 4, "replicas": 1, "inodes": 2, "fp8": True}),
    ("tiny_qwen2", {}, {"tp": 2, "replicas": 3}),  # tied embeddings, qkv biases, 1 kv head
    ("tiny_qwen2", {}, {"tp": 1, "replicas": 2, "fp8": True}),
    ("tiny_moe", {}, {"ep": 2, "tp": 2, "iep": 2}),  # experts across engine EP ranks
    ("tiny_moe", {}, {"ep": 4, "layout": "contiguous", "tp": 2, "iep": 1, "fp8": True}),
    ("tiny_deepseek_v3", {}, {"ep": 2, "tp": 2, "iep": 2, "fp8": True}),
    ("tiny_deepseek_v3", {}, {"nodes": 1, "gpus": 4, "nics": 1, "ep": 2, "tp": 1}),
]


@pytest.mark.parametrize("gather", ["shard_direct", "full"])
@pytest.mark.parametrize(("name", "changes", "shape"), CASES)
def test_plan_lands_reference_bytes(name, changes, shape, gather):
    cl = cluster(**shape)
    plan = run_and_compare(model(name, **changes), cl, min_piece_bytes=1, gather=gather)
    assert plan.num_tasks > 0
    assert bool(plan.direct_params) == (gather == "shard_direct")


@pytest.mark.parametrize("gather", ["shard_direct", "full"])
@pytest.mark.parametrize("fp8", [False, True])
def test_stacked_expert_naming(fp8, gather):
    cfg = model("tiny_moe")
    cl = cluster(ep=2, tp=2, iep=2, fp8=fp8)
    plan = run_and_compare(cfg, cl, expert_naming="stacked", min_piece_bytes=1, gather=gather)
    # stacked experts live on the 2-D (EP x FSDP) mesh over every rank: the same ranks
    # as the dense mesh, so one scheduling mesh and one group
    assert plan.num_groups == 1
    assert any(len(p.mesh.shape) == 2 for p in plan.params)


def test_canonical_gather_order_lands_the_same_bytes():
    cfg = model("tiny_deepseek_v3")
    plan = run_and_compare(cfg, cluster(ep=2, tp=2, iep=2, fp8=True), gather_order="canonical")
    for order in plan.group_params:
        for mesh in {plan.param_mesh[p] for p in order}:
            mine = [p for p in order if plan.param_mesh[p] == mesh]
            assert mine == sorted(mine), "canonical: each mesh gathers in metadata order"


@st.composite
def random_setup(draw):
    arch = draw(st.sampled_from(["llama", "qwen2", "qwen3_moe", "deepseek_v3"]))
    fp8 = draw(st.booleans())
    tp = draw(st.sampled_from([1, 2, 4] if arch in ("llama", "qwen3_moe") else [1, 2]))
    changes = {"num_hidden_layers": draw(st.integers(1, 3)),
               "vocab_size": draw(st.integers(65, 700)),
               "tie_word_embeddings": draw(st.booleans())}
    base = {"llama": "tiny_llama", "qwen2": "tiny_qwen2", "qwen3_moe": "tiny_moe",
            "deepseek_v3": "tiny_deepseek_v3"}[arch]
    if arch == "deepseek_v3":
        changes["num_hidden_layers"] = draw(st.integers(2, 3))  # first layer is dense
    if not fp8:
        changes["intermediate_size"] = 64 * draw(st.integers(1, 4)) * tp
    experts = 8 if arch in ("qwen3_moe", "deepseek_v3") else 1
    gpus = draw(st.sampled_from([1, 2, 4]))
    nodes = draw(st.integers(1, 3))
    world = nodes * gpus
    ep = draw(st.sampled_from([d for d in (1, 2, 4, 8) if world % d == 0 and experts % d == 0]))
    # engine EP=1 cuts each expert by TP: FP8 needs moe_intermediate_size (256) / tp >= 128
    engine_ep = [1, tp] if experts % tp == 0 else [1]
    if fp8 and experts > 1 and 256 // tp < 128:
        engine_ep = [tp]
    shape = {
        "nodes": nodes, "gpus": gpus, "nics": draw(st.sampled_from([d for d in (1, 2, 4)
                                                                  if gpus % d == 0])),
        "ep": ep, "layout": draw(st.sampled_from(["strided", "contiguous"])),
        "replicas": draw(st.integers(1, 2)), "tp": tp,
        "iep": draw(st.sampled_from(engine_ep)),
        "inodes": draw(st.sampled_from([d for d in (1, 2) if tp % d == 0])),
        "inics": draw(st.integers(1, 2)), "fp8": fp8,
    }
    naming = draw(st.sampled_from(["per_expert", "stacked"])) if experts > 1 else "per_expert"
    plan_kw = {"min_piece_bytes": draw(st.sampled_from([1, 4096, 1 << 20])),
               "pieces_per_nic": draw(st.integers(1, 64)),
               "gather": draw(st.sampled_from(["shard_direct", "full"]))}
    return base, changes, shape, naming, plan_kw, draw(st.integers(0, 3))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.slow
@given(random_setup())
def test_random_models_meshes_and_degrees_land_reference_bytes(setup):
    base, changes, shape, naming, plan_kw, seed = setup
    event(f"{base} fp8={shape['fp8']} {naming} tp={shape['tp']} engine_ep={shape['iep']}")
    cfg = model(base, **changes)
    run_and_compare(cfg, cluster(**shape), expert_naming=naming, seed=seed, **plan_kw)


def test_replay_refuses_a_task_whose_parameter_the_group_never_gathers():
    cfg, cl = model("tiny_llama"), cluster()
    tm = trainer_meta_from_config(cfg, cl)
    plan = compute_plan(tm, engine_metas_from_config(cfg, cl), cl, model=cfg, gather="full")
    tp = plan.trainer_plan(0)
    g0 = tp.groups[0]
    dropped = next(t.piece.src_param for t in g0.tasks)
    lean = dataclasses.replace(
        tp, groups=(dataclasses.replace(g0, params=tuple(p for p in g0.params if p != dropped)),
                    *tp.groups[1:]))
    with pytest.raises(ValueError, match="never gathers"):
        replay_in_memory(plan, random_state_dict(cfg, seed=0), trainer_plans=[lean])
