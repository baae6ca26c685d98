"""The :class:`Architecture` interface: what one architecture module tells the rest of the project.

An architecture is a stateless object (one per module, found by name through
:func:`weight_transfer.model.arch.get_architecture`). The defaults describe a
Llama-style decoder layer - GQA attention, a SwiGLU MLP or routed experts,
two RMSNorms - so a module overrides only what its family does differently::

    arch = get_architecture(cfg.architecture)
    arch.layer_params(cfg, 3, "stacked")   # trainer parameters of layer 3
    arch.layer_rules(cfg, 3)               # engine tensors of layer 3 and their sources
    arch.is_moe_layer(cfg, 3)
    arch.hf_config_class, arch.hf_fields(cfg)   # for the trainer model builder

Everything here is pure Python: the transformers config class is a name that
``weight_transfer.engines.reference.hf_model`` resolves.
"""

from __future__ import annotations

from typing import Any

from weight_transfer.model.arch.common import (
    DENSE_MLP,
    LAYER_NORMS,
    MoeKeys,
    Params,
    Rule,
    TrainerParamSpec,
    dense_mlp_params,
    expert_rules,
    expert_specs,
    gqa_params,
    gqa_rules,
    router_rules,
    router_specs,
    specs,
)
from weight_transfer.model.arch.shape import ModelShape


class Architecture:
    """Everything the project knows about one architecture (defaults: a dense GQA decoder)."""

    name: str = ""
    # transformers config class (a name in the ``transformers`` namespace) the trainer
    # model builder instantiates; None: no trainer model for this architecture
    hf_config_class: str | None = None
    reference_engine: bool = True  # the reference engine can run it
    required_fields: tuple[str, ...] = ()  # ModelConfig fields that must be set
    experts_field: str | None = None  # ModelConfig field with the routed expert count
    expert_size_field: str = "moe_intermediate_size"  # intermediate size of one expert
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    moe_keys: MoeKeys = MoeKeys()
    # a Hugging Face config.json key -> the ModelConfig field it is (when they differ)
    hf_key_aliases: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        return f"<architecture {self.name}>"

    # ---------------------------------------------------------------- config
    def check(self, cfg: ModelShape) -> list[str]:
        """``"field: problem"`` lines beyond the missing required fields (none by default)."""
        return []

    def is_moe_layer(self, cfg: ModelShape, layer: int) -> bool:
        return False

    def qkv_bias(self, cfg: ModelShape) -> bool:
        return bool(cfg.attention_bias)

    def o_bias(self, cfg: ModelShape) -> bool:
        return bool(cfg.attention_bias)

    def has_router_bias(self, cfg: ModelShape) -> bool:
        return False

    def norm_topk(self, cfg: ModelShape) -> bool:
        """Whether the top-k routing weights are renormalized to sum to 1."""
        return bool(cfg.norm_topk_prob)

    # ---------------------------------------------------------------- trainer parameters
    def attention_params(self, cfg: ModelShape) -> Params:
        return gqa_params(
            cfg, qkv_bias=self.qkv_bias(cfg), o_bias=self.o_bias(cfg), qk_norm=self.qk_norm
        )

    def moe_params(self, cfg: ModelShape, layer: int, naming: str) -> list[TrainerParamSpec]:
        return router_specs(cfg, layer, self.moe_keys, naming) + expert_specs(
            cfg, layer, self.moe_keys, naming
        )

    def layer_params(self, cfg: ModelShape, layer: int, naming: str) -> list[TrainerParamSpec]:
        """Trainer parameters of decoder layer ``layer`` in module order, full names."""
        p, h, dt = f"model.layers.{layer}.", cfg.hidden_size, cfg.torch_dtype
        out = specs(p, self.attention_params(cfg), dt, layer)
        if self.is_moe_layer(cfg, layer):
            out += self.moe_params(cfg, layer, naming)
        else:
            out += specs(p, dense_mlp_params("mlp", h, cfg.intermediate_size), dt, layer)
        norms = [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
        return out + specs(p, norms, dt, layer)

    # ---------------------------------------------------------------- engine rules
    def attention_rules(self, cfg: ModelShape) -> tuple[Rule, ...]:
        return gqa_rules(qkv_bias=self.qkv_bias(cfg), o_bias=self.o_bias(cfg),
                         qk_norm=self.qk_norm)

    def moe_rules(self, cfg: ModelShape) -> tuple[Rule, ...]:
        return router_rules(self.moe_keys) + expert_rules(self.moe_keys)

    def layer_rules(self, cfg: ModelShape, layer: int) -> tuple[Rule, ...]:
        """The rule table of decoder layer ``layer``: attention, MLP or MoE, norms."""
        mlp = self.moe_rules(cfg) if self.is_moe_layer(cfg, layer) else DENSE_MLP
        return self.attention_rules(cfg) + mlp + LAYER_NORMS

    # ---------------------------------------------------------------- trainer model builder
    def hf_fields(self, cfg: ModelShape) -> dict[str, Any]:
        """transformers config fields beyond the ones every architecture shares
        (sizes, heads, vocab, activation, norm eps, RoPE, tied embeddings)."""
        return {"head_dim": cfg.head_size, "attention_bias": bool(cfg.attention_bias)}
