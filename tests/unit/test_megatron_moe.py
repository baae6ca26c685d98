"""Megatron MoE layers as a source, pure: the Qwen3-MoE name table, experts made global by
their EP rank, placed on the expert mesh and cut over expert TP, and a whole plan of
tiny_moe from Megatron shards at TP x EP landing the reference bytes.

The Megatron side is written plainly here from a Hugging Face state dict (each expert's
``linear_fc1`` is, per expert-TP rank, its gate rows then its up rows; experts numbered
locally per EP rank); ``tests/integration/test_megatron_trainers.py`` checks the same on a
real megatron-core model at EP=2.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from actors.tools.testkit.simnic_engines import SimnicEngines, one_replica_cluster
from scheduling import compute_plan
from scheduling.config_metadata import engine_metas_from_config
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.arch.megatron_moe import map_expert_name
from weight_transfer.model.models import load_model_config
from weight_transfer.sources.megatron import TpBlock
from weight_transfer.sources.megatron_layout import (
    LocalParam,
    MegatronDims,
    describe,
    stage_mesh,
)
from weight_transfer.types import MeshDesc, Placement, TrainerMeta

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "configs" / "models" / "tiny_moe.yaml"
L1 = "decoder.layers.1.mlp."

# (Megatron name, model index of local expert 0, experts per EP rank) -> Hugging Face names
NAMES = [
    (L1 + "router.weight", 4, 4, ("model.layers.1.mlp.gate.weight",)),
    (L1 + "experts.local_experts.2.linear_fc1.weight", 4, 4,
     ("model.layers.1.mlp.experts.6.gate_proj.weight",
      "model.layers.1.mlp.experts.6.up_proj.weight")),
    (L1 + "experts.local_experts.3.linear_fc2.weight", 0, 4,
     ("model.layers.1.mlp.experts.3.down_proj.weight",)),
    # Transformer Engine's grouped experts
    (L1 + "experts.linear_fc1.weight1", 4, 4,
     ("model.layers.1.mlp.experts.5.gate_proj.weight",
      "model.layers.1.mlp.experts.5.up_proj.weight")),
    (L1 + "experts.linear_fc2.weight0", 4, 4, ("model.layers.1.mlp.experts.4.down_proj.weight",)),
    # no rule: a local index past the rank's experts, shared experts, a layer not in the stage
    (L1 + "experts.local_experts.4.linear_fc1.weight", 4, 4, None),
    (L1 + "shared_experts.linear_fc1.weight", 0, 4, None),
    ("decoder.layers.7.mlp.router.weight", 0, 4, None),
]


@pytest.mark.parametrize(("name", "first", "per_rank", "want"), NAMES)
def test_expert_names_become_the_models(name, first, per_rank, want):
    got = map_expert_name(name, {1: 1}, first_expert=first, experts_per_rank=per_rank)
    assert (got and got[1]) == want


DIMS = MegatronDims(tp=2, heads=4, query_groups=2, etp=2, experts_per_rank=4, first_expert=4)
MESH = MeshDesc(ranks=(0, 1, 2, 3), shape=(2, 2), dim_names=("dp", "tp"))
EXPERT_MESH = MeshDesc(ranks=(2, 3), shape=(1, 2), dim_names=("dp", "tp"))
FC1 = LocalParam(name=L1 + "experts.local_experts.1.linear_fc1.weight", shape=(256, 64),
                 dtype="bfloat16", tensor_parallel=True, partition_dim=0)


def test_experts_are_cut_over_expert_tp_on_the_expert_mesh():
    router = LocalParam(name=L1 + "router.weight", shape=(8, 64), dtype="bfloat16")
    parts = describe([FC1, router], dims=DIMS, mesh=MESH, global_layer={1: 1}, where="r",
                     expert_mesh=EXPERT_MESH)
    gate, up, gate_w = parts
    assert (gate.meta.name, up.meta.name) == ("model.layers.1.mlp.experts.5.gate_proj.weight",
                                              "model.layers.1.mlp.experts.5.up_proj.weight")
    assert gate.meta.shape == up.meta.shape == (256, 64)  # 128 rows a rank, over ETP 2
    assert gate.meta.mesh == EXPERT_MESH and gate.expert and gate.dim == 0
    assert gate.meta.placements == (Placement(kind="replicate"), Placement(kind="shard", dim=0))
    assert (gate.bands.ranges(), up.bands.ranges()) == ([(0, 128)], [(128, 256)])
    assert gate_w.meta.mesh == MESH and not gate_w.expert and gate_w.dim is None


@pytest.mark.parametrize(("param", "mesh", "words"), [
    (dataclasses.replace(FC1, partition_dim=None), EXPERT_MESH, "has no partition_dim"),
    (FC1, None, "expert mesh (expert data-parallel and expert-TP groups) is missing"),
    (dataclasses.replace(FC1, name=L1 + "experts.local_experts.4.linear_fc1.weight"),
     EXPERT_MESH, "has no destination"),
])
def test_bad_expert_parameters_are_refused_naming_parameter_and_rank(param, mesh, words):
    with pytest.raises(ValueError, match="trainer rank 3") as err:
        describe([param], dims=DIMS, mesh=MESH, global_layer={1: 1}, where="trainer rank 3",
                 expert_mesh=mesh)
    assert param.name in str(err.value) and words in str(err.value)


# ------------------------------------------------------------------ a whole plan of tiny_moe

ATTN = {"input_layernorm.weight": "input_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight"}


def fc1(gate, up, tp, rank):
    """A rank's ``linear_fc1`` shard: its gate rows, then its up rows."""
    return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])


def megatron_rank(cfg, hf, *, t, e, tp, ep):
    """The Megatron parameters of TP rank ``t`` (= expert-TP rank) and EP rank ``e``, shards
    as ``(tensor, partition_dim)``."""
    groups, per_rank = cfg.kv_heads, cfg.n_experts // ep

    def cut(w, dim):
        return w.chunk(tp, dim)[t], dim

    out = {"embedding.word_embeddings.weight": cut(hf["model.embed_tokens.weight"], 0),
           "output_layer.weight": cut(hf["lm_head.weight"], 0),
           "decoder.final_layernorm.weight": (hf["model.norm.weight"], None)}
    for i in range(cfg.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out |= {m + a: (hf[p + b], None) for a, b in ATTN.items()}
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"].chunk(groups) for x in "qkv")
        qkv = torch.cat([x for g in range(groups) for x in (q[g], k[g], v[g])])
        out[m + "self_attention.linear_qkv.weight"] = cut(qkv, 0)
        out[m + "self_attention.linear_proj.weight"] = cut(hf[p + "self_attn.o_proj.weight"], 1)
        if i in cfg.mlp_only_layers:
            out[m + "mlp.linear_fc1.weight"] = (fc1(hf[p + "mlp.gate_proj.weight"],
                                                    hf[p + "mlp.up_proj.weight"], tp, t), 0)
            out[m + "mlp.linear_fc2.weight"] = cut(hf[p + "mlp.down_proj.weight"], 1)
            continue
        out[m + "mlp.router.weight"] = (hf[p + "mlp.gate.weight"], None)
        for j in range(per_rank):
            x, local = f"{p}mlp.experts.{e * per_rank + j}.", f"{m}mlp.experts.local_experts.{j}."
            out[local + "linear_fc1.weight"] = (fc1(hf[x + "gate_proj.weight"],
                                                    hf[x + "up_proj.weight"], tp, t), 0)
            out[local + "linear_fc2.weight"] = cut(hf[x + "down_proj.weight"], 1)
    return out


# (TP = expert TP, EP, engine TP) on TP x EP ranks, Megatron's order (TP innermost, then DP
# for dense parameters, EP for experts; expert data parallel is 1): every expert shard
# inside one engine rank's into TP 2, gathered over expert TP into TP 1
PLANS = [(2, 2, 2), (2, 2, 1)]


@pytest.mark.parametrize(("tp", "ep", "engine_tp"), PLANS)
def test_megatron_experts_land_the_reference_bytes(tp, ep, engine_tp):
    cfg = load_model_config(MOE)
    hf = random_state_dict(cfg, seed=5)
    world, per_rank = tp * ep, cfg.n_experts // ep
    dims = MegatronDims(tp=tp, heads=cfg.num_attention_heads, query_groups=cfg.kv_heads,
                        etp=tp, experts_per_rank=per_rank)
    ranks = []
    for rank in range(world):
        t, e = rank % tp, rank // tp
        shards = megatron_rank(cfg, hf, t=t, e=e, tp=tp, ep=ep)
        params = [LocalParam(name=n, shape=tuple(w.shape), dtype="bfloat16",
                             tensor_parallel=d is not None, partition_dim=d)
                  for n, (w, d) in shards.items()]
        tp_ranks = tuple(range(e * tp, (e + 1) * tp))
        parts = describe(params, dims=dataclasses.replace(dims, first_expert=e * per_rank),
                         mesh=stage_mesh(rank, tp_ranks, tuple(range(t, world, tp))),
                         global_layer={i: i for i in range(cfg.num_hidden_layers)},
                         where=f"trainer rank {rank}",
                         expert_mesh=stage_mesh(rank, tp_ranks, (rank,)))
        blocks = {p.meta.name: TpBlock(data=shards[p.source][0], bands=p.bands,
                                       shape=p.meta.shape, dim=p.dim, group=None, world=tp)
                  for p in parts}
        ranks.append(([p.meta for p in parts], blocks))
    metas = {m.name: m for ms, _ in ranks for m in ms}
    assert all(m == metas[m.name] for ms, _ in ranks for m in ms)  # ranks agree
    assert set(metas) == set(hf)
    cl = one_replica_cluster(trainer_ranks=world, tp=engine_tp)
    tm = TrainerMeta(params=tuple(metas.values()), ranks=cl.rank_infos())
    with SimnicEngines(engine_metas_from_config(cfg, cl)) as eng:
        plan = compute_plan(tm, eng.engines, cl, model=cfg)
        plan.validate()
        direct = {tm.params[i].name for i in plan.direct_params}
        if engine_tp % tp == 0:  # every engine shard inside one trainer block
            assert direct == set(metas)
        for rank, (_, blocks) in enumerate(ranks):
            local = {n: b if n in direct else hf[n] for n, b in blocks.items()}
            report = eng.run(plan, tm.params, rank, local.__getitem__)
            assert report.bytes_written == report.bytes_planned
        assert eng.mismatches(cfg, hf, fp8=False) == []
