"""Model architectures by hyper-parameters, and the exact trainer parameters they imply.

A :class:`ModelConfig` holds the fields of a Hugging Face ``config.json`` that
decide tensor names and shapes, plus ``architecture``. Configs live in
``configs/models/*.yaml`` and are read with :func:`load_model_config`, which
turns any problem into a ``ValueError`` naming the file and the field.

:func:`trainer_param_specs` lists every trainer parameter with its Hugging Face
checkpoint name and global shape without allocating any tensor (Kimi-K2, 1T
parameters: well under a second). Two namings of MoE experts are accepted:

* ``"per_expert"`` - the checkpoint's names, one 2-D tensor per expert:
  ``model.layers.3.mlp.experts.7.gate_proj.weight`` ``[moe_inter, hidden]``;
* ``"stacked"`` - transformers 5 builds ``Qwen3MoeExperts`` / DeepSeek-V3 experts
  as 3-D parameters without a ``.weight`` suffix:
  ``mlp.experts.gate_up_proj`` ``[E, 2 * moe_inter, hidden]`` (gate rows first,
  then up: its forward does ``linear(x, gate_up_proj[e]).chunk(2, dim=-1)``) and
  ``mlp.experts.down_proj`` ``[E, hidden, moe_inter]``.

DeepSeek-V3's multi-token-prediction layer (``num_nextn_predict_layers``) is in
the checkpoint but not in the trained model (transformers and vLLM's main model
both skip it), so it is not listed. Seeded random weights of a tiny
config for tests and the demo are in :mod:`reference.random_state`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, PrivateAttr, model_validator

from weight_transfer.config_files import load_yaml
from weight_transfer.types import DTYPE_SIZES

Architecture = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]
ExpertNaming = Literal["per_expert", "stacked"]
EXPERT_NAMINGS: tuple[str, ...] = ("per_expert", "stacked")
MOE_ARCHITECTURES = ("qwen3_moe", "deepseek_v3")
_REQUIRED: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "deepseek_v3": (
        "n_routed_experts",
        "moe_intermediate_size",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    ),
}


class ModelConfig(BaseModel):
    """An architecture and the ``config.json`` fields that fix names and shapes.

    Fields that do not change any tensor (rope, eps, routing constants) are
    accepted so a ``config.json`` can be copied as it is; unknown fields are an
    error. ``ignore_params`` lists fnmatch patterns of trainer or engine tensor
    names that the mapping may leave without a destination or a source.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Architecture
    name: str = ""
    hidden_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    intermediate_size: PositiveInt
    vocab_size: PositiveInt
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    torch_dtype: str = "bfloat16"
    # mixture of experts (qwen3_moe: num_experts; deepseek_v3: n_routed_experts)
    num_experts: PositiveInt | None = None
    n_routed_experts: PositiveInt | None = None
    num_experts_per_tok: PositiveInt | None = None
    moe_intermediate_size: PositiveInt | None = None
    n_shared_experts: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: PositiveInt = 1
    decoder_sparse_step: PositiveInt = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool | None = None
    topk_method: str | None = None
    scoring_func: str | None = None
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    # multi-head latent attention (deepseek_v3)
    q_lora_rank: PositiveInt | None = None
    kv_lora_rank: PositiveInt | None = None
    qk_nope_head_dim: PositiveInt | None = None
    qk_rope_head_dim: PositiveInt | None = None
    v_head_dim: PositiveInt | None = None
    num_nextn_predict_layers: int = 0
    # no effect on tensors
    hidden_act: str = "silu"
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int | None = None
    ignore_params: tuple[str, ...] = ()

    _cache: dict[Any, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.torch_dtype not in DTYPE_SIZES:
            raise ValueError(f"torch_dtype: unknown dtype {self.torch_dtype!r}")
        for field in _REQUIRED.get(self.architecture, ()):
            if getattr(self, field) is None:
                raise ValueError(f"{field}: required for architecture {self.architecture!r}")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_key_value_heads: {self.kv_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"head_dim: not given and hidden_size={self.hidden_size} is not a multiple "
                f"of num_attention_heads={self.num_attention_heads}"
            )
        if self.first_k_dense_replace < 0 or self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace: {self.first_k_dense_replace} out of range")
        return self

    # ------------------------------------------------------------ derived sizes
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def n_experts(self) -> int:
        return self.num_experts or self.n_routed_experts or 0

    @property
    def qk_head_dim(self) -> int:
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)

    @property
    def qkv_bias(self) -> bool:
        """q/k/v biases: always in Qwen2, ``attention_bias`` in Llama and Qwen3."""
        return self.architecture == "qwen2" or bool(self.attention_bias)

    @property
    def o_bias(self) -> bool:
        return self.architecture in ("llama", "qwen3", "qwen3_moe") and bool(self.attention_bias)

    @property
    def has_router_bias(self) -> bool:
        return self.architecture == "deepseek_v3" and self.topk_method in (None, "noaux_tc")

    def is_moe_layer(self, layer: int) -> bool:
        if self.architecture == "qwen3_moe":
            return (
                layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
            )
        if self.architecture == "deepseek_v3":
            return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        return False

    def __eq__(self, other: object) -> bool:
        """Equal when the fields are (the memo is not part of the value)."""
        if not isinstance(other, ModelConfig):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(self.model_dump_json())  # rope_scaling is a dict: hash its JSON

    def __getstate__(self) -> dict[Any, Any]:
        """Pickle without the memo: a config sent to another process stays small."""
        state = super().__getstate__()
        return {**state, "__pydantic_private__": {"_cache": {}}}

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """Memoize ``build()`` on this (immutable) config."""
        cache = self._cache
        if cache.get("__owner__") is not self:  # model_copy shares the dict: start afresh
            cache = self._cache = {"__owner__": self}
        if key not in cache:
            cache[key] = build()
        return cache[key]


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a ``configs/models/*.yaml``; ValueError names the file and the field."""
    return load_yaml(ModelConfig, path, kind="model")


# --------------------------------------------------------------------------- trainer params


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerParamSpec:
    """One trainer parameter by its Hugging Face name, global shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    expert: int | None = None
    layer: int | None = None


def _attention(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    h, hd = cfg.hidden_size, cfg.head_size
    q, kv = cfg.num_attention_heads * hd, cfg.kv_heads * hd
    out: list[tuple[str, tuple[int, ...]]] = []
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append((f"self_attn.{proj}.weight", (rows, h)))
        if cfg.qkv_bias:
            out.append((f"self_attn.{proj}.bias", (rows,)))
    out.append(("self_attn.o_proj.weight", (h, q)))
    if cfg.o_bias:
        out.append(("self_attn.o_proj.bias", (h,)))
    if cfg.architecture in ("qwen3", "qwen3_moe"):
        out += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    return out


def _mla(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    kvl, rope = cfg.kv_lora_rank or 0, cfg.qk_rope_head_dim or 0
    nope, v = cfg.qk_nope_head_dim or 0, cfg.v_head_dim or 0
    if cfg.q_lora_rank:
        ql = cfg.q_lora_rank
        q = [
            ("self_attn.q_a_proj.weight", (ql, h)),
            ("self_attn.q_a_layernorm.weight", (ql,)),
            ("self_attn.q_b_proj.weight", (nh * cfg.qk_head_dim, ql)),
        ]
    else:
        q = [("self_attn.q_proj.weight", (nh * cfg.qk_head_dim, h))]
    return [
        *q,
        ("self_attn.kv_a_proj_with_mqa.weight", (kvl + rope, h)),
        ("self_attn.kv_a_layernorm.weight", (kvl,)),
        ("self_attn.kv_b_proj.weight", (nh * (nope + v), kvl)),
        ("self_attn.o_proj.weight", (h, nh * v)),
    ]


def _dense_mlp(prefix: str, h: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (f"{prefix}.gate_proj.weight", (inter, h)),
        (f"{prefix}.up_proj.weight", (inter, h)),
        (f"{prefix}.down_proj.weight", (h, inter)),
    ]


def _layer_specs(cfg: ModelConfig, i: int, naming: str) -> list[TrainerParamSpec]:
    p, h, dt = f"model.layers.{i}.", cfg.hidden_size, cfg.torch_dtype
    attn = _mla(cfg) if cfg.architecture == "deepseek_v3" else _attention(cfg)
    out = [TrainerParamSpec(name=p + n, shape=s, dtype=dt, layer=i) for n, s in attn]
    if not cfg.is_moe_layer(i):
        out += [
            TrainerParamSpec(name=p + n, shape=s, dtype=dt, layer=i)
            for n, s in _dense_mlp("mlp", h, cfg.intermediate_size)
        ]
    else:
        out += _moe_specs(cfg, i, naming)
    out += [
        TrainerParamSpec(name=p + n, shape=(h,), dtype=dt, layer=i)
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight")
    ]
    return out


def _moe_specs(cfg: ModelConfig, i: int, naming: str) -> list[TrainerParamSpec]:
    p, h, dt = f"model.layers.{i}.mlp.", cfg.hidden_size, cfg.torch_dtype
    e_count, inter = cfg.n_experts, cfg.moe_intermediate_size or 0
    out = [TrainerParamSpec(name=p + "gate.weight", shape=(e_count, h), dtype=dt, layer=i)]
    if cfg.has_router_bias:
        out.append(
            TrainerParamSpec(
                name=p + "gate.e_score_correction_bias", shape=(e_count,), dtype="float32", layer=i
            )
        )
    if naming == "stacked":
        out += [
            TrainerParamSpec(name=p + "experts.gate_up_proj", shape=(e_count, 2 * inter, h),
                             dtype=dt, layer=i),
            TrainerParamSpec(name=p + "experts.down_proj", shape=(e_count, h, inter),
                             dtype=dt, layer=i),
        ]
    else:
        shapes = _dense_mlp("", h, inter)
        out += [
            TrainerParamSpec(name=f"{p}experts.{e}{n}", shape=s, dtype=dt, expert=e, layer=i)
            for e in range(e_count)
            for n, s in shapes
        ]
    if cfg.architecture == "deepseek_v3" and cfg.n_shared_experts:
        out += [
            TrainerParamSpec(name=p + n, shape=s, dtype=dt, layer=i)
            for n, s in _dense_mlp("shared_experts", h, inter * cfg.n_shared_experts)
        ]
    return out


def check_expert_naming(expert_naming: str) -> None:
    if expert_naming not in EXPERT_NAMINGS:
        raise ValueError(f"expert_naming must be one of {EXPERT_NAMINGS}, not {expert_naming!r}")


def trainer_param_specs(
    cfg: ModelConfig, *, expert_naming: str = "per_expert"
) -> list[TrainerParamSpec]:
    """Every parameter of the trained model, in module order, with HF names and shapes.

    Tied embeddings (``tie_word_embeddings``) list only ``model.embed_tokens.weight``,
    as ``named_parameters()`` does. DeepSeek's ``e_score_correction_bias`` is float32.
    """
    check_expert_naming(expert_naming)
    return list(cfg.cached(("trainer_specs", expert_naming), lambda: _build(cfg, expert_naming)))


def _build(cfg: ModelConfig, naming: str) -> tuple[TrainerParamSpec, ...]:
    v, h, dt = cfg.vocab_size, cfg.hidden_size, cfg.torch_dtype
    out = [TrainerParamSpec(name="model.embed_tokens.weight", shape=(v, h), dtype=dt)]
    for i in range(cfg.num_hidden_layers):
        out += _layer_specs(cfg, i, naming)
    out.append(TrainerParamSpec(name="model.norm.weight", shape=(h,), dtype=dt))
    if not cfg.tie_word_embeddings:
        out.append(TrainerParamSpec(name="lm_head.weight", shape=(v, h), dtype=dt))
    return tuple(out)


def trainer_param_shapes(cfg: ModelConfig, *, expert_naming: str = "per_expert") -> dict:
    """``{name: TrainerParamSpec}`` of :func:`trainer_param_specs` (memoized on ``cfg``)."""
    check_expert_naming(expert_naming)
    return cfg.cached(
        ("trainer_by_name", expert_naming),
        lambda: {s.name: s for s in trainer_param_specs(cfg, expert_naming=expert_naming)},
    )


def param_count(cfg: ModelConfig) -> int:
    """Number of trained parameters (checkpoint minus the MTP layer)."""
    return sum(math.prod(s.shape) for s in trainer_param_specs(cfg))
