"""The trainer's transformers model: names and shapes of our tables, seeded weights, greedy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_transfer.engines.reference.hf_model import (
    build_hf_model,
    expert_naming_of,
    float_logits,
    greedy_generate,
    hf_config,
)
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.models import ModelConfig, load_model_config
from weight_transfer.model.models import trainer_param_specs as specs_of

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
TINY_QWEN3 = ModelConfig(
    architecture="qwen3", name="tiny-qwen3", hidden_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
    vocab_size=300, tie_word_embeddings=True, rope_theta=1e6,
)


def cfg_of(name: str) -> ModelConfig:
    return TINY_QWEN3 if name == "tiny_qwen3" else load_model_config(MODELS / f"{name}.yaml")


@pytest.mark.parametrize(
    "name, naming",
    [("tiny_llama", "per_expert"), ("tiny_qwen2", "per_expert"), ("tiny_qwen3", "per_expert"),
     ("tiny_moe", "stacked"), ("tiny_mixtral", "stacked")],
)
def test_parameters_are_the_trainer_specs(name, naming):
    cfg = cfg_of(name)
    model = build_hf_model(cfg, seed=0)
    assert expert_naming_of(model) == naming
    have = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    want = {s.name: (s.shape, torch.bfloat16) for s in specs_of(cfg, expert_naming=naming)}
    assert have == want
    assert not model.training


def test_weights_are_the_seeded_random_state_dict():
    cfg = cfg_of("tiny_moe")
    model = build_hf_model(cfg, seed=5)
    state = random_state_dict(cfg, seed=5, expert_naming="stacked")
    for name, param in model.named_parameters():
        assert torch.equal(param, state[name]), name
    again = build_hf_model(cfg, seed=5)
    other = build_hf_model(cfg, seed=6)
    w = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(again.get_parameter(w), model.get_parameter(w))
    assert not torch.equal(other.get_parameter(w), model.get_parameter(w))


def test_tied_embeddings_share_the_head():
    model = build_hf_model(cfg_of("tiny_qwen2"), seed=1)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_config_fields_reach_transformers():
    cfg = cfg_of("tiny_moe")
    hc = hf_config(cfg)
    assert (hc.num_experts, hc.moe_intermediate_size, hc.mlp_only_layers) == (8, 256, [0])
    assert hc.rope_parameters["rope_theta"] == 1e6 and hc.head_dim == 128
    assert hc.norm_topk_prob is True and hc.num_key_value_heads == 2


def test_unsupported_architecture_and_rope_are_refused():
    with pytest.raises(ValueError, match=r"deepseek_v3.*not supported by the demo"):
        hf_config(load_model_config(MODELS / "tiny_deepseek_v3.yaml"))
    yarn = cfg_of("tiny_llama").model_copy(update={"rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match=r"rope_scaling .* not supported"):
        hf_config(yarn)


@pytest.mark.slow
def test_greedy_generate_is_argmax_of_float32_logits():
    cfg = cfg_of("tiny_llama")
    model = build_hf_model(cfg, seed=2)
    prompts = [[1, 2, 3], [7, 8, 9], [400, 5]]
    got = greedy_generate(model, prompts, max_new_tokens=4)
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = list(prompt)
        for _ in range(4):
            ids.append(int(float_logits(model, torch.tensor([ids]))[0, -1].argmax()))
        assert tokens == ids[len(prompt) :]
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # float copy only
    assert greedy_generate(model, prompts, max_new_tokens=4) == got


def test_greedy_generate_checks_prompts():
    model = build_hf_model(cfg_of("tiny_qwen2"), seed=0)
    with pytest.raises(ValueError, match=r"prompt 1: token ids \[640\]"):
        greedy_generate(model, [[1], [640]], max_new_tokens=1)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        greedy_generate(model, [[]], max_new_tokens=1)


def test_moe_without_top_k_is_refused():
    cfg = cfg_of("tiny_moe").model_copy(update={"num_experts_per_tok": None})
    with pytest.raises(ValueError, match="num_experts_per_tok is required"):
        hf_config(cfg)
