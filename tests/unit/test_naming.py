"""Rule tables: every trainer parameter has exactly one destination, FP8 and bf16 sets."""

from pathlib import Path

import pytest

from weight_transfer.model.models import load_model_config, trainer_param_specs
from weight_transfer.model.naming import (
    STACKED_PARAMS_MAPPING,
    Split,
    all_sources,
    bound_rules,
    canonical_trainer_name,
    expert_sources,
    layer_blocks,
    name_problems,
    scale_name,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
TINY = ["tiny_llama", "tiny_qwen2", "tiny_moe", "tiny_deepseek_v3", "tiny_mixtral"]


def cfg(name):
    return load_model_config(CONFIGS / f"{name}.yaml")


@pytest.mark.parametrize("name", [*TINY, "deepseek_v3", "qwen3_235b_a22b", "llama3_70b"])
@pytest.mark.parametrize("naming", ["per_expert", "stacked"])
def test_every_trainer_param_is_the_source_of_exactly_one_engine_tensor(name, naming):
    c = cfg(name)
    counts: dict[str, int] = {}
    for rule in bound_rules(c):
        for src in all_sources(c, rule, naming):
            counts[src] = counts.get(src, 0) + 1
    names = [s.name for s in trainer_param_specs(c, expert_naming=naming)]
    assert sorted(counts) == sorted(names)
    assert set(counts.values()) == {1}
    assert name_problems(c, naming, names, ()) == []


def test_stacked_params_mapping_is_vllms():
    assert ("qkv_proj", "k_proj", "k") in STACKED_PARAMS_MAPPING
    assert ("gate_up_proj", "up_proj", 1) in STACKED_PARAMS_MAPPING
    assert ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1) in STACKED_PARAMS_MAPPING


@pytest.mark.parametrize(
    ("name", "layer", "engine", "sources", "split"),
    [
        ("tiny_llama", 0, "self_attn.qkv_proj.weight",
         ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         Split.QKV),
        ("tiny_qwen2", 0, "self_attn.qkv_proj.bias",
         ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), Split.QKV),
        ("tiny_llama", 0, "mlp.down_proj.weight", ("mlp.down_proj.weight",), Split.ROW),
        ("tiny_moe", 1, "mlp.experts.w13_weight",
         ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
         Split.EXPERTS_COLUMN),
        ("tiny_moe", 1, "self_attn.q_norm.weight", ("self_attn.q_norm.weight",),
         Split.REPLICATED),
        ("tiny_deepseek_v3", 0, "self_attn.fused_qkv_a_proj.weight",
         ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"), Split.REPLICATED),
        ("tiny_deepseek_v3", 1, "mlp.shared_experts.gate_up_proj.weight",
         ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
         Split.COLUMN),
        ("tiny_deepseek_v3", 0, "self_attn.kv_b_proj.weight", ("self_attn.kv_b_proj.weight",),
         Split.COLUMN),
        ("tiny_mixtral", 0, "block_sparse_moe.experts.w13_weight",
         ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
         Split.EXPERTS_COLUMN),
        ("tiny_mixtral", 1, "block_sparse_moe.experts.w2_weight",
         ("block_sparse_moe.experts.{e}.w2.weight",), Split.EXPERTS_ROW),
        ("tiny_mixtral", 0, "block_sparse_moe.gate.weight", ("block_sparse_moe.gate.weight",),
         Split.REPLICATED),
    ],
)
def test_layer_tables(name, layer, engine, sources, split):
    rules = {r.engine: r for r in layer_blocks(cfg(name), layer)}
    assert rules[engine].sources == sources
    assert rules[engine].split == split


def test_what_stays_bf16_under_fp8():
    for name in TINY:
        for rule in bound_rules(cfg(name)):
            last = rule.engine.rsplit(".", 1)[-1]
            module = rule.engine.rsplit(".", 2)[-2]
            linear = last in ("w13_weight", "w2_weight") or (last == "weight" and "proj" in module)
            assert rule.fp8 == linear, rule.engine
    bias = next(r for r in bound_rules(cfg("tiny_deepseek_v3")) if "correction" in r.engine)
    assert bias.dtype == "float32"


@pytest.mark.parametrize(
    ("name", "engine", "per_expert", "stacked"),
    [
        ("tiny_moe", "model.layers.1.mlp.experts.w13_weight",
         ("model.layers.1.mlp.experts.3.gate_proj.weight",
          "model.layers.1.mlp.experts.3.up_proj.weight"),
         ("model.layers.1.mlp.experts.gate_up_proj",)),
        ("tiny_mixtral", "model.layers.1.block_sparse_moe.experts.w2_weight",
         ("model.layers.1.block_sparse_moe.experts.3.w2.weight",),
         ("model.layers.1.mlp.experts.down_proj",)),
        ("tiny_mixtral", "model.layers.0.block_sparse_moe.gate.weight",
         ("model.layers.0.block_sparse_moe.gate.weight",), ("model.layers.0.mlp.gate.weight",)),
    ],
)
def test_sources_under_each_expert_naming(name, engine, per_expert, stacked):
    rule = next(r for r in bound_rules(cfg(name)) if r.engine == engine)
    if rule.split in (Split.EXPERTS_COLUMN, Split.EXPERTS_ROW):
        assert expert_sources(rule, 3, "per_expert") == per_expert
        assert expert_sources(rule, 3, "stacked") == stacked
    else:
        assert all_sources(cfg(name), rule, "per_expert") == per_expert
        assert all_sources(cfg(name), rule, "stacked") == stacked


def test_dense_and_moe_layers_of_deepseek():
    c = cfg("tiny_deepseek_v3")  # first_k_dense_replace = 1
    assert "mlp.gate_up_proj.weight" in {r.engine for r in layer_blocks(c, 0)}
    assert "mlp.experts.w2_weight" in {r.engine for r in layer_blocks(c, 1)}


def test_tied_models_have_no_lm_head_and_accept_its_alias():
    c = cfg("tiny_qwen2")
    assert "lm_head.weight" not in {r.engine for r in bound_rules(c)}
    names = [s.name for s in trainer_param_specs(c)] + ["lm_head.weight"]
    assert name_problems(c, "per_expert", names, ()) == []


def test_canonical_names_and_scale_names():
    assert (
        canonical_trainer_name("_orig_mod.model._checkpoint_wrapped_module.layers.0.mlp.w")
        == "model.layers.0.mlp.w"
    )
    assert scale_name("a.qkv_proj.weight") == "a.qkv_proj.weight_scale_inv"
    assert scale_name("a.experts.w13_weight") == "a.experts.w13_weight_scale_inv"
    with pytest.raises(ValueError, match="no FP8 scale name"):
        scale_name("a.qkv_proj.bias")
