"""Model architectures by hyper-parameters, and the exact trainer parameters they imply.

A :class:`ModelConfig` holds the fields of a Hugging Face ``config.json`` that
decide tensor names and shapes, plus ``architecture``: a name registered in
:mod:`weight_transfer.model.arch`, whose module knows the layers of that family
(``cfg.arch``). Configs live in ``configs/models/*.yaml`` and are read with
:func:`load_model_config`, which turns any problem into a ``ValueError`` naming
the file and the field.

A Hugging Face ``config.json`` is accepted as it is (a ``.json`` or YAML file, a
``save_pretrained`` folder, a mapping, a ``PretrainedConfig``): unknown keys are
kept in ``hf_extra`` and ignored, keys that change tensors are honoured or
refused by name (:mod:`weight_transfer.model.hf_config`). The trainer's own model
describes itself::

    cfg = model_config_from_hf(model)          # the live nn.Module (its .config and dtype)
    cfg = model_config_from_hf(LlamaConfig(...))
    cfg = load_model_config("ckpt/config.json")

:func:`trainer_param_specs` lists every trainer parameter with its Hugging Face
checkpoint name and global shape without allocating any tensor (Kimi-K2, 1T
parameters: well under a second). Two namings of MoE experts are accepted:

* ``"per_expert"`` - the checkpoint's names, one 2-D tensor per expert:
  ``model.layers.3.mlp.experts.7.gate_proj.weight`` ``[moe_inter, hidden]``;
* ``"stacked"`` - transformers 5 builds ``Qwen3MoeExperts`` / DeepSeek-V3 / Mixtral
  experts as 3-D parameters without a ``.weight`` suffix:
  ``mlp.experts.gate_up_proj`` ``[E, 2 * moe_inter, hidden]`` (gate rows first,
  then up: its forward does ``linear(x, gate_up_proj[e]).chunk(2, dim=-1)``) and
  ``mlp.experts.down_proj`` ``[E, hidden, moe_inter]``.

Each architecture module spells its own names (Mixtral's checkpoint:
``block_sparse_moe.experts.{e}.w1.weight``; see :mod:`weight_transfer.model.arch.mixtral`).
:class:`TrainerParamSpec` is a :class:`~weight_transfer.types.TensorSpec` with
the decoder ``layer`` and, under per_expert naming, the ``expert``. Seeded
random weights of a tiny config for tests and the demo are in
:mod:`weight_transfer.engines.reference.random_state`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    PositiveInt,
    PrivateAttr,
    field_validator,
    model_validator,
)

from weight_transfer.config_files import StrictModel, read_yaml, validate_mapping
from weight_transfer.model.arch import Architecture, get_architecture
from weight_transfer.model.arch.common import TrainerParamSpec
from weight_transfer.model.hf_config import fields_from_hf, is_hf_config
from weight_transfer.types import DTYPE_SIZES

ExpertNaming = Literal["per_expert", "stacked"]
EXPERT_NAMINGS: tuple[str, ...] = ("per_expert", "stacked")


class ModelConfig(StrictModel):
    """An architecture and the ``config.json`` fields that fix names and shapes.

    Fields that do not change any tensor (rope, eps, routing constants) are
    accepted; in our own YAML unknown fields are an error, while a Hugging Face
    mapping (with ``model_type``) is read by :func:`weight_transfer.model.hf_config.fields_from_hf`
    (its other keys land in ``hf_extra``). ``ignore_params`` lists fnmatch
    patterns of trainer or engine tensor names that the mapping may leave
    without a destination or a source.
    """

    architecture: str  # a name registered in weight_transfer.model.arch
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
    # mixture of experts (qwen3_moe: num_experts; deepseek_v3: n_routed_experts;
    # mixtral: num_local_experts, each of intermediate_size)
    num_experts: PositiveInt | None = None
    n_routed_experts: PositiveInt | None = None
    num_local_experts: PositiveInt | None = None
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
    hf_extra: dict[str, Any] = {}  # a config.json's keys that change no tensor, not read

    _cache: dict[Any, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_hf(cls, data: Any) -> Any:
        if is_hf_config(data):
            return fields_from_hf(data, known=cls.model_fields)
        return data

    @field_validator("architecture")
    @classmethod
    def _registered(cls, name: str) -> str:
        get_architecture(name)  # ValueError listing the registered names
        return name

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.torch_dtype not in DTYPE_SIZES:
            raise ValueError(f"torch_dtype: unknown dtype {self.torch_dtype!r}")
        for field in self.arch.required_fields:
            if getattr(self, field) is None:
                raise ValueError(f"{field}: required for architecture {self.architecture!r}")
        problems = self.arch.check(self)
        if problems:
            raise ValueError(f"architecture {self.architecture!r}: " + "; ".join(problems))
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
    def arch(self) -> Architecture:
        """The registered architecture object (its module knows the layers)."""
        return get_architecture(self.architecture)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def n_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense architecture)."""
        field = self.arch.experts_field
        return (getattr(self, field) or 0) if field else 0

    @property
    def expert_intermediate_size(self) -> int:
        """Intermediate size of one routed expert (0 when the config has none)."""
        return getattr(self, self.arch.expert_size_field) or 0

    @property
    def qk_head_dim(self) -> int:
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)

    @property
    def qkv_bias(self) -> bool:
        """q/k/v biases: always in Qwen2, ``attention_bias`` in Llama and Qwen3."""
        return self.arch.qkv_bias(self)

    @property
    def o_bias(self) -> bool:
        return self.arch.o_bias(self)

    @property
    def has_router_bias(self) -> bool:
        return self.arch.has_router_bias(self)

    def is_moe_layer(self, layer: int) -> bool:
        return self.arch.is_moe_layer(self, layer)

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
    """Read a ``configs/models/*.yaml``, a Hugging Face ``config.json`` or a folder holding
    one (``save_pretrained``); ValueError names the file and the field (or the refused key)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return model_config_from_mapping(read_yaml(path, kind="model"), source=str(path))


def model_config_from_mapping(data: Any, *, source: str = "<dict>") -> ModelConfig:
    """A model config from a parsed mapping, ours or a Hugging Face one (errors name
    ``source``)."""
    if is_hf_config(data):
        data = fields_from_hf(data, known=ModelConfig.model_fields, source=source)
    return validate_mapping(ModelConfig, data, kind="model", source=source)


def model_config_from_hf(model_or_config: Any, *, source: str | None = None,
                         **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a live model or a Hugging Face config.

    ``model_or_config``: a ``torch.nn.Module`` with a ``.config`` (its parameters' dtype
    wins over the config's), a ``PretrainedConfig``, a mapping, or a path
    (:func:`load_model_config`). ``overrides`` set fields (``name``, ``ignore_params``).
    """
    obj, extra = model_or_config, {}
    if isinstance(obj, str | Path):
        path = Path(obj) / "config.json" if Path(obj).is_dir() else Path(obj)
        obj, source = read_yaml(path, kind="model"), source or str(path)
    if hasattr(obj, "named_parameters") and hasattr(obj, "config"):
        dtypes = [p.dtype for _, p in obj.named_parameters() if p.is_floating_point()]
        if dtypes:
            extra["torch_dtype"] = str(dtypes[0]).removeprefix("torch.")
        obj = obj.config
    data = obj.to_dict() if hasattr(obj, "to_dict") else obj
    where = source or f"<{type(model_or_config).__name__}>"
    if not isinstance(data, dict):
        raise ValueError(f"{where}: not a model, a Hugging Face config or a mapping")
    return model_config_from_mapping({**data, **extra, **overrides}, source=where)


# --------------------------------------------------------------------------- trainer params


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
    v, h, dt, arch = cfg.vocab_size, cfg.hidden_size, cfg.torch_dtype, cfg.arch
    out = [TrainerParamSpec(name="model.embed_tokens.weight", shape=(v, h), dtype=dt)]
    for i in range(cfg.num_hidden_layers):
        out += arch.layer_params(cfg, i, naming)
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
