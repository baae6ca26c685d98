"""A Hugging Face config.json as it is: configs from transformers give the exact trainer
parameters of the transformers model (built on the meta device), save_pretrained files
load unedited, and keys that change tensors we cannot express are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from weight_transfer.model.hf_config import ConfigKeyError
from weight_transfer.model.live_metadata import expert_naming_of, param_metas_from_module
from weight_transfer.model.models import (
    ModelConfig,
    load_model_config,
    model_config_from_hf,
    trainer_param_specs,
)

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(SMALL, head_dim=32, attention_bias=True)),
    "mistral": (transformers.MistralConfig, dict(SMALL, head_dim=16, sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, dict(SMALL, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(SMALL, head_dim=32)),
    "qwen3_moe": (transformers.Qwen3MoeConfig,
                  dict(SMALL, **MOE, num_experts=4, mlp_only_layers=[0], head_dim=16)),
    "deepseek_v3": (transformers.DeepseekV3Config,
                    dict(SMALL, **MOE, n_routed_experts=4, n_shared_experts=1,
                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
                         topk_group=1, num_key_value_heads=4)),
    "mixtral": (transformers.MixtralConfig, dict(SMALL, num_local_experts=4,
                                                 num_experts_per_tok=2)),
}
ARCH = {"mistral": "llama"}


def hf_config(name: str) -> transformers.PretrainedConfig:
    cls, kwargs = CONFIGS[name]
    return cls(**kwargs)


def meta_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_live_model_and_its_config_give_the_same_trainer_parameters(name):
    model = meta_model(hf_config(name))
    naming = expert_naming_of(model)
    live = {m.name: (m.shape, m.dtype) for m in param_metas_from_module(model)}
    for source in (model, model.config, model.config.to_dict()):
        cfg = model_config_from_hf(source)
        assert cfg.architecture == ARCH.get(name, name)
        want = {s.name: (s.shape, s.dtype) for s in trainer_param_specs(cfg, expert_naming=naming)}
        assert {n: s for n, (s, _) in want.items()} == {n: s for n, (s, _) in live.items()}
        # dtypes too, but DeepSeek's router bias: float32 in the checkpoint, cast by dtype=
        same = [n for n in want if not n.endswith("e_score_correction_bias")]
        assert [want[n][1] for n in same] == [live[n][1] for n in same]
    assert ModelConfig(**model.config.to_dict()) == model_config_from_hf(model.config.to_dict())


def test_unknown_keys_are_kept_and_ignored():
    cfg = ModelConfig(**transformers.LlamaConfig().to_dict())  # 22 errors before
    assert cfg.architecture == "llama" and cfg.rope_theta == 10000.0
    assert cfg.hf_extra["attention_dropout"] == 0.0
    assert cfg.hf_extra["transformers_version"] == transformers.__version__
    assert cfg.hf_extra["model_type"] == "llama"
    assert len(trainer_param_specs(cfg)) == 2 + 32 * 9 + 1


def test_save_pretrained_config_json_loads_as_it_is(tmp_path):
    config = hf_config("qwen3_moe")
    config.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert '"num_local_experts"' in text or '"num_experts"' in text
    for path in (tmp_path, tmp_path / "config.json"):
        cfg = load_model_config(path)
        assert (cfg.architecture, cfg.num_experts, cfg.mlp_only_layers) == ("qwen3_moe", 4, (0,))
        assert cfg.rope_theta == config.rope_parameters["rope_theta"]
    names = {s.name for s in trainer_param_specs(cfg, expert_naming="stacked")}
    assert "model.layers.1.mlp.experts.gate_up_proj" in names


def test_a_yaml_copy_of_config_json_with_its_architecture_key(tmp_path):
    data = transformers.MixtralConfig(**CONFIGS["mixtral"][1]).to_dict()
    path = tmp_path / "mixtral.yaml"
    path.write_text(yaml.safe_dump({"architecture": "mixtral", **data}))
    assert load_model_config(path).num_local_experts == 4


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"mlp_bias": True}, "mlp_bias"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
        ({"text_config": {"hidden_size": 8}}, "text_config"),
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type"),
        ({"architecture": "qwen3"}, "architecture"),
    ],
)
def test_a_key_we_cannot_honour_is_refused_by_name(tmp_path, change, key):
    data = {**transformers.LlamaConfig(**SMALL).to_dict(), **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigKeyError, match=key) as info:
        load_model_config(path)
    assert isinstance(info.value, ValueError) and info.value.key == key
    assert str(path) in str(info.value) and repr(change[key])[:10] in str(info.value)
    with pytest.raises(ValueError, match=key):
        ModelConfig(**data)


def test_neutral_values_of_tensor_keys_are_accepted():
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    cfg = model_config_from_hf({**transformers.LlamaConfig(**SMALL).to_dict(),
                                "mlp_bias": False, "quantization_config": fp8})
    assert cfg.hf_extra["quantization_config"] == fp8


def test_our_own_yaml_stays_strict(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text((ROOT / "configs/models/tiny_llama.yaml").read_text() + "hidden_sise: 5\n")
    with pytest.raises(ValueError, match="hidden_sise"):
        load_model_config(path)


def test_wt_config_check_knows_a_config_json(tmp_path):
    from actors.tools.cli.config_cmd import check

    hf_config("mixtral").save_pretrained(tmp_path)
    kind, cfg, facts = check(tmp_path / "config.json")
    assert (kind, cfg.architecture) == ("model", "mixtral")
    assert ("trainer parameters", str(len(trainer_param_specs(cfg)))) in facts


def test_the_model_type_table_of_the_registry(monkeypatch):
    import weight_transfer.model.arch as registry

    assert registry.architecture_for_hf("kimi_k2") == "deepseek_v3"
    assert registry.architecture_for_hf(None, ["MistralForCausalLM"]) == "llama"
    assert registry.architecture_for_hf("gpt2", ["GPT2LMHeadModel"]) is None
    monkeypatch.setattr(registry, "_HF_TABLE", list(registry._HF_TABLE))
    registry.register_hf_model_type("my_llama", "MyLlamaForCausalLM", "llama")
    data = {**transformers.LlamaConfig(**SMALL).to_dict(), "model_type": "my_llama"}
    assert model_config_from_hf(data).architecture == "llama"
