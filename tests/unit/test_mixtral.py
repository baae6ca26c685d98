"""Mixtral through the whole stack, from its one architecture module.

Names and shapes are checked against what transformers 5 builds (``stacked``)
and what it saves as a checkpoint (``per_expert``: ``block_sparse_moe.experts.{e}.w1``
...); plans for TP=1/2 and EP=2, bf16 and FP8, both namings, land exactly the
bytes of the reference loader (which spells Mixtral's keys on its own). The
reference engine's logits and greedy generations equal the transformers
model's in test_engine_reference.py, parametrized over every tiny config.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from actors.tools.testkit.replay import replay_in_memory
from scheduling import compute_plan
from scheduling.cluster.config import cluster_from_dict
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.engines.reference.hf_model import build_hf_model, expert_naming_of, hf_config
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.layout.engine_layout import engine_tensor_specs
from weight_transfer.model.models import ModelConfig, load_model_config, trainer_param_specs
from weight_transfer.model.naming import Split, bound_rules, layer_blocks
from weight_transfer.plan.wire import dumps_trainer_plan, loads_trainer_plan
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.types import ShardSpec

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
CFG = load_model_config(CONFIGS / "tiny_mixtral.yaml")  # H 256, 4 experts of I 256, top-2
L0 = "model.layers.0."


@pytest.fixture(scope="module")
def model():
    return build_hf_model(CFG, seed=1)


def shapes(naming: str) -> dict[str, tuple[int, ...]]:
    return {s.name: s.shape for s in trainer_param_specs(CFG, expert_naming=naming)}


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_stacked_names_are_the_transformers_model(model):
    assert type(model).__name__ == "MixtralForCausalLM"
    assert expert_naming_of(model) == "stacked"
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes("stacked")
    assert shapes("stacked")[L0 + "mlp.experts.gate_up_proj"] == (4, 512, 256)
    assert shapes("stacked")[L0 + "mlp.experts.down_proj"] == (4, 256, 256)
    assert shapes("stacked")[L0 + "mlp.gate.weight"] == (4, 256)


@pytest.mark.slow
def test_per_expert_names_are_the_checkpoint_transformers_saves(model, tmp_path):
    model.save_pretrained(tmp_path)
    ckpt = load_file(tmp_path / "model.safetensors")
    assert {n: tuple(t.shape) for n, t in ckpt.items()} == shapes("per_expert")
    # w1 = gate (first rows of gate_up_proj), w3 = up, w2 = down
    gate_up = model.get_parameter(L0 + "mlp.experts.gate_up_proj")
    down = model.get_parameter(L0 + "mlp.experts.down_proj")
    e = L0 + "block_sparse_moe.experts.2."
    assert torch.equal(ckpt[e + "w1.weight"], gate_up[2, :256])
    assert torch.equal(ckpt[e + "w3.weight"], gate_up[2, 256:])
    assert torch.equal(ckpt[e + "w2.weight"], down[2])
    # the reference loader reads the checkpoint and the transformers state alike
    state = model.state_dict()
    for shard in (ShardSpec(), ShardSpec(tp_rank=1, tp_size=2),
                  ShardSpec(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)):
        a = load_engine_shard(CFG, ckpt, shard, fp8=True)
        b = load_engine_shard(CFG, state, shard, fp8=True)
        assert list(a) == list(b)
        assert all(torch.equal(u8(a[k]), u8(b[k])) for k in a), shard


def test_rule_table_is_vllms_mixtral():
    rules = {r.engine: r for r in layer_blocks(CFG, 1)}
    assert list(rules) == [
        "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
        "block_sparse_moe.gate.weight", "block_sparse_moe.experts.w13_weight",
        "block_sparse_moe.experts.w2_weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]
    w13 = rules["block_sparse_moe.experts.w13_weight"]
    assert w13.sources == ("block_sparse_moe.experts.{e}.w1.weight",
                           "block_sparse_moe.experts.{e}.w3.weight")
    assert (w13.split, w13.fp8, w13.stacked) == (Split.EXPERTS_COLUMN, True,
                                                 ("mlp.experts.gate_up_proj",))
    router = rules["block_sparse_moe.gate.weight"]
    assert (router.split, router.fp8, router.stacked) == (Split.REPLICATED, False,
                                                          ("mlp.gate.weight",))
    assert all(CFG.is_moe_layer(i) for i in range(CFG.num_hidden_layers))
    assert not any("bias" in r.engine for r in bound_rules(CFG))


@pytest.mark.parametrize(
    ("shard", "w13", "w2"),
    [
        (ShardSpec(), (4, 512, 256), (4, 256, 256)),
        (ShardSpec(tp_rank=1, tp_size=2), (4, 256, 256), (4, 256, 128)),  # I cut by TP
        (ShardSpec(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2), (2, 512, 256), (2, 256, 256)),
    ],
)
def test_engine_expert_shapes(shard, w13, w2):
    specs = {s.name: s for s in engine_tensor_specs(CFG, shard, fp8=True)}
    m = L0 + "block_sparse_moe."
    assert specs[m + "experts.w13_weight"].shape == w13
    assert specs[m + "experts.w2_weight"].shape == w2
    assert specs[m + "experts.w13_weight_scale_inv"].shape == (w13[0], w13[1] // 128, 2)
    assert (specs[m + "gate.weight"].shape, specs[m + "gate.weight"].dtype) == ((4, 256),
                                                                                "bfloat16")


def cluster(*, tp: int, iep: int, fp8: bool, ep: int = 2):
    return cluster_from_dict({
        "name": "test",
        "trainer": {"nodes": 2, "gpus_per_node": 2, "nics_per_node": 2, "nic_gbps": 100,
                    "expert_parallel": ep},
        "inference": {"replicas": 2, "gpus_per_replica": tp, "tensor_parallel": tp,
                      "expert_parallel": iep, "nodes_per_replica": 1, "nics_per_node": 2,
                      "nic_gbps": 100, "fp8": fp8},
    })


@pytest.mark.parametrize(
    ("tp", "iep", "fp8", "naming"),
    [
        (1, 1, False, "per_expert"),
        (1, 1, True, "stacked"),
        (2, 1, False, "stacked"),
        (2, 1, True, "per_expert"),  # experts cut by TP on I: 128-row FP8 blocks stay whole
        (2, 2, False, "per_expert"),  # engine EP: whole experts per rank
        (2, 2, True, "stacked"),
    ],
)
@pytest.mark.slow
def test_plan_lands_reference_bytes(tp, iep, fp8, naming):
    cl = cluster(tp=tp, iep=iep, fp8=fp8)
    tm = trainer_meta_from_config(CFG, cl, expert_naming=naming)
    em = engine_metas_from_config(CFG, cl)
    plan = compute_plan(tm, em, cl, model=CFG, expert_naming=naming, min_piece_bytes=1)
    plan.validate()
    state = random_state_dict(CFG, seed=3, expert_naming=naming)
    received = [loads_trainer_plan(dumps_trainer_plan(plan.trainer_plan(r.rank)))
                for r in tm.ranks]
    got = replay_in_memory(plan, state, trainer_plans=received)
    reference = {}
    for e in em:
        if e.shard not in reference:
            reference[e.shard] = load_engine_shard(CFG, state, e.shard, fp8=fp8)
        want, tensors = reference[e.shard], got[(e.replica, e.rank)]
        assert set(tensors) == set(want), (e.replica, e.rank)
        for name, ref in want.items():
            assert torch.equal(tensors[name], as_bytes(ref)), (e.replica, e.rank, name)


def test_transformers_config_fields():
    hc = hf_config(CFG)
    assert type(hc).__name__ == "MixtralConfig"
    assert (hc.num_local_experts, hc.num_experts_per_tok, hc.intermediate_size) == (4, 2, 256)
    assert (hc.head_dim, hc.num_key_value_heads, hc.rms_norm_eps) == (128, 2, 1e-5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_local_experts": None}, "num_local_experts: required for architecture 'mixtral'"),
        ({"num_experts_per_tok": None}, "num_experts_per_tok: required"),
        ({"attention_bias": True}, "attention_bias: mixtral has no attention biases"),
    ],
)
def test_config_errors_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**CFG.model_dump(), **changes})
