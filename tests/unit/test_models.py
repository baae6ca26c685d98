"""Model configs: YAML validation, exact HF names and shapes, parameter counts, speed."""

import math
import pickle
import time
from pathlib import Path

import pytest
import torch

from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.models import (
    ModelConfig,
    load_model_config,
    param_count,
    trainer_param_specs,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def cfg(name: str) -> ModelConfig:
    return load_model_config(CONFIGS / f"{name}.yaml")


def by_name(c: ModelConfig, naming: str = "per_expert") -> dict:
    return {s.name: s for s in trainer_param_specs(c, expert_naming=naming)}


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("llama3_70b", 70.5e9, 70.6e9),
        ("qwen3_235b_a22b", 235.0e9, 235.2e9),
        ("deepseek_v3", 670.9e9, 671.1e9),  # 671B without the 14B MTP layer
        ("kimi_k2", 1.025e12, 1.028e12),
    ],
)
def test_parameter_counts_of_the_big_configs(name, low, high):
    assert low <= param_count(cfg(name)) <= high


def test_kimi_k2_specs_are_fast_and_complete():
    c = cfg("kimi_k2")
    start = time.perf_counter()
    specs = trainer_param_specs(c)
    elapsed = time.perf_counter() - start
    print(f"kimi_k2 trainer_param_specs: {len(specs)} params in {elapsed * 1e3:.0f} ms")
    names = {s.name for s in specs}
    assert len(names) == len(specs) == 69975
    # 60 MoE layers x 384 experts x 3 projections
    assert sum(s.expert is not None for s in specs) == 60 * 384 * 3
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the one dense layer
    assert "model.layers.1.mlp.experts.383.down_proj.weight" in names
    assert "model.layers.61.input_layernorm.weight" not in names


def test_llama_layer_names_and_shapes_exactly():
    c = cfg("tiny_llama")  # hidden 256, 4 heads x 128, 2 kv heads, inter 512, vocab 1000
    specs = [s for s in trainer_param_specs(c) if s.layer == 1]
    assert [(s.name.removeprefix("model.layers.1."), s.shape) for s in specs] == [
        ("self_attn.q_proj.weight", (512, 256)),
        ("self_attn.k_proj.weight", (256, 256)),
        ("self_attn.v_proj.weight", (256, 256)),
        ("self_attn.o_proj.weight", (256, 512)),
        ("mlp.gate_proj.weight", (512, 256)),
        ("mlp.up_proj.weight", (512, 256)),
        ("mlp.down_proj.weight", (256, 512)),
        ("input_layernorm.weight", (256,)),
        ("post_attention_layernorm.weight", (256,)),
    ]
    names = by_name(c)
    assert names["model.embed_tokens.weight"].shape == (1000, 256)
    assert names["lm_head.weight"].shape == (1000, 256)


def test_qwen2_has_qkv_biases_and_tied_embeddings():
    names = by_name(cfg("tiny_qwen2"))
    assert names["model.layers.0.self_attn.k_proj.bias"].shape == (128,)
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert "lm_head.weight" not in names


def test_deepseek_mla_moe_and_router_bias():
    c = cfg("deepseek_v3")
    names = by_name(c)
    a = "model.layers.5.self_attn."
    assert names[a + "q_a_proj.weight"].shape == (1536, 7168)
    assert names[a + "q_b_proj.weight"].shape == (128 * 192, 1536)
    assert names[a + "kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert names[a + "kv_b_proj.weight"].shape == (128 * 256, 512)
    assert names[a + "o_proj.weight"].shape == (7168, 128 * 128)
    bias = names["model.layers.5.mlp.gate.e_score_correction_bias"]
    assert (bias.shape, bias.dtype) == ((256,), "float32")
    assert names["model.layers.5.mlp.shared_experts.gate_proj.weight"].shape == (2048, 7168)
    assert "model.layers.2.mlp.gate.weight" not in names  # first_k_dense_replace = 3
    assert names["model.layers.2.mlp.gate_proj.weight"].shape == (18432, 7168)


def test_stacked_naming_is_transformers5_3d_experts():
    c = cfg("qwen3_235b_a22b")
    stacked, per = by_name(c, "stacked"), by_name(c, "per_expert")
    assert stacked["model.layers.3.mlp.experts.gate_up_proj"].shape == (128, 2 * 1536, 4096)
    assert stacked["model.layers.3.mlp.experts.down_proj"].shape == (128, 4096, 1536)
    assert "model.layers.3.mlp.experts.7.gate_proj.weight" in per
    assert sum(math.prod(s.shape) for s in stacked.values()) == param_count(c)
    with pytest.raises(ValueError, match="expert_naming"):
        trainer_param_specs(c, expert_naming="fused")


def test_qwen3_moe_dense_layers_from_mlp_only_layers():
    names = by_name(cfg("tiny_moe"))
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.self_attn.q_norm.weight" in names


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"hidden_sise": 5}, "hidden_sise"),  # typo: extra fields are refused
        ({"torch_dtype": "bf16"}, "torch_dtype"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"architecture": "gpt2"}, "architecture"),
    ],
)
def test_bad_yaml_names_file_and_field(tmp_path, patch, field):
    text = (CONFIGS / "tiny_llama.yaml").read_text()
    path = tmp_path / "bad.yaml"
    lines = [ln for ln in text.splitlines() if not ln.startswith(tuple(patch))]
    path.write_text("\n".join(lines + [f"{k}: {v}" for k, v in patch.items()]))
    with pytest.raises(ValueError, match=field) as info:
        load_model_config(path)
    assert str(path) in str(info.value)


def test_moe_architecture_requires_its_fields(tmp_path):
    path = tmp_path / "moe.yaml"
    text = (CONFIGS / "tiny_moe.yaml").read_text().replace("num_experts: 8\n", "")
    path.write_text(text)
    with pytest.raises(ValueError, match="num_experts: required"):
        load_model_config(path)


def test_non_mapping_and_missing_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        load_model_config(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_model_config(tmp_path / "absent.yaml")


def test_random_state_dict_is_seeded_and_complete():
    c = cfg("tiny_deepseek_v3")
    a = random_state_dict(c, seed=3)
    b = random_state_dict(c, seed=3)
    d = random_state_dict(c, seed=4)
    assert list(a) == [s.name for s in trainer_param_specs(c)]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.norm.weight"], d["model.norm.weight"])
    bias = a["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32
    assert a["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.bfloat16
    for s in trainer_param_specs(c):
        assert tuple(a[s.name].shape) == s.shape


def test_random_state_dict_refuses_big_models():
    with pytest.raises(ValueError, match="tiny configs"):
        random_state_dict(cfg("llama3_70b"), seed=0)


def test_memo_is_neither_shared_by_copies_nor_pickled():
    c = cfg("tiny_llama")
    assert len(trainer_param_specs(c)) == 21
    wider = c.model_copy(update={"num_hidden_layers": 3})
    assert len(trainer_param_specs(wider)) == 30
    assert len(trainer_param_specs(c)) == 21
    clone = pickle.loads(pickle.dumps(c))
    assert clone == c and hash(clone) == hash(c) and len(pickle.dumps(c)) < 2000
    assert wider != c
    assert len(trainer_param_specs(clone)) == 21
