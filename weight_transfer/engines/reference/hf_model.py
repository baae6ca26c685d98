"""The trainer's model: a Hugging Face transformers model built from a :class:`ModelConfig`.

Nothing is downloaded: :func:`hf_config` turns our config into the transformers
config class its architecture module names (``arch.hf_config_class``, e.g.
``LlamaConfig``, ``MixtralConfig``) with the fields every architecture shares
plus ``arch.hf_fields(cfg)``, and :func:`build_hf_model` builds the model from
it and fills every parameter with
:func:`weight_transfer.engines.reference.random_state.random_state_dict`
of the same seed, so::

    model = build_hf_model(cfg, seed=3)
    naming = expert_naming_of(model)   # "stacked" for transformers-5 MoE models
    dict(model.named_parameters()) == random_state_dict(cfg, seed=3, expert_naming=naming)
    tokens = greedy_generate(model, [[1, 2, 3]], max_new_tokens=8)

Parameter names and shapes are exactly ``trainer_param_specs(cfg, expert_naming=naming)``
(checked at build time: a mismatch is a ValueError listing the differences).
:func:`greedy_generate` and :func:`float_logits` compute in float32 on a
float32 copy of the weights (the model itself is untouched), recomputing the
whole prefix at every step, with no sampling: the oracle the reference engine's
generations are compared with, token for token. :func:`fp8_float_copy` is the
model as an FP8 engine computes with it (every projection weight through FP8
block quantization and back), the oracle for FP8 engines' logits.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

try:
    import transformers
except ImportError as exc:  # the reference extra: the library itself does not need it
    raise ImportError(
        "the reference engine's Hugging Face model (the ready-made TrainerActor, the demo's "
        "checks) needs transformers: pip install 'weight-transfer[reference]'") from exc

from weight_transfer.engines.reference.ops import (
    activation,
    check_prompts,
    greedy_loop,
    rms_eps,
    rope_theta,
)
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.layout.quant import dequantize_fp8_blocks, quantize_fp8_blocks
from weight_transfer.model.arch import architecture_names, get_architecture
from weight_transfer.model.live_metadata import expert_naming_of
from weight_transfer.model.models import ModelConfig, trainer_param_specs

logger = logging.getLogger(__name__)


def _config_class(cfg: ModelConfig):
    name = cfg.arch.hf_config_class
    if name is None:
        supported = [n for n in architecture_names() if get_architecture(n).hf_config_class]
        raise ValueError(
            f"{cfg.name or cfg.architecture}: architecture {cfg.architecture!r} is not "
            f"supported by the demo (supported: {supported})"
        )
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(
            f"{cfg.name or cfg.architecture}: transformers {transformers.__version__} has no "
            f"{name} (architecture {cfg.architecture!r})"
        )
    return cls


def hf_config(cfg: ModelConfig) -> transformers.PretrainedConfig:
    """The transformers config of ``cfg`` (ValueError for deepseek_v3 and scaled RoPE)."""
    cls = _config_class(cfg)
    activation(cfg)  # same activations as the reference engine
    fields = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": rms_eps(cfg),
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta(cfg)},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings or 4096,
    }
    fields.update(cfg.arch.hf_fields(cfg))
    return cls(**fields)


def check_param_names(model: nn.Module, cfg: ModelConfig, expert_naming: str) -> None:
    """ValueError if the model's parameters differ from ``trainer_param_specs`` in name or shape."""
    want = {s.name: s.shape for s in trainer_param_specs(cfg, expert_naming=expert_naming)}
    have = {n: tuple(p.shape) for n, p in model.named_parameters()}
    problems = [f"missing {n} {s}" for n, s in want.items() if n not in have]
    problems += [f"unexpected {n} {s}" for n, s in have.items() if n not in want]
    problems += [
        f"{n}: shape {have[n]}, expected {s}" for n, s in want.items() if n in have and have[n] != s
    ]
    if problems:
        raise ValueError(
            f"transformers model of {cfg.name or cfg.architecture} does not match "
            f"trainer_param_specs (expert_naming={expert_naming}): " + "; ".join(problems[:10])
        )


def build_hf_model(cfg: ModelConfig, *, seed: int, dtype: torch.dtype = torch.bfloat16):
    """A random-initialized causal LM (eval mode), parameters = random_state_dict(seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # transformers' own init runs first; make it seeded too
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dtype)
    naming = expert_naming_of(model)
    check_param_names(model, cfg, naming)
    state = random_state_dict(cfg, seed=seed, expert_naming=naming, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    logger.debug("built %s (%s experts) with seed %d", cfg.name, naming, seed)
    return model.eval()


def _float_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).float().eval()


def _fp8_roundtrip(t: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8_blocks(*quantize_fp8_blocks(t))


def fp8_weight(name: str, t: torch.Tensor) -> torch.Tensor:
    """Float32 value an FP8 engine computes with for HF parameter ``name``.

    As FP8 checkpoints store it (and ``load_engine_shard(fp8=True)`` loads it): each
    projection weight quantized on its own, stacked experts per expert and per
    gate/up half; every other tensor unchanged.
    """
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = t.chunk(2, dim=1)
        return torch.cat([_fp8_roundtrip(gate), _fp8_roundtrip(up)], dim=1)
    if name.endswith("mlp.experts.down_proj") or (
        name.endswith(".weight") and "proj" in name.split(".")[-2]
    ):
        return _fp8_roundtrip(t)
    return t.float()


@torch.no_grad()
def fp8_float_copy(model: nn.Module) -> nn.Module:
    """A float32 copy of ``model`` with every projection weight quantized and dequantized."""
    out = _float_copy(model)
    for name, param in out.named_parameters():
        param.copy_(fp8_weight(name, model.get_parameter(name)))
    return out


@torch.no_grad()
def float_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] of ``input_ids`` [B, T], computed in float32 on a copy."""
    return _float_copy(model)(input_ids=input_ids, use_cache=False).logits.float()


@torch.no_grad()
def greedy_generate(
    model: nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations (new tokens only) of each prompt, in float32, no KV cache.

    Prompts of equal length run as one batch; each step recomputes the full prefix.
    """
    check_prompts(prompts, model.config.vocab_size, max_new_tokens)
    fmodel = _float_copy(model)
    return greedy_loop(
        prompts, max_new_tokens,
        lambda ids: fmodel(input_ids=ids, use_cache=False).logits[:, -1],
    )
