"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention, routed experts in most layers.

A layer is MoE unless it is listed in ``mlp_only_layers``, and only every
``decoder_sparse_step``-th layer is (``(layer + 1) % step == 0``). Experts:
``num_experts`` of size ``moe_intermediate_size``, router ``mlp.gate.weight``,
no shared experts; the checkpoint names them ``mlp.experts.{e}.gate_proj.weight``
and transformers 5 builds ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]``.
Routing: softmax, top ``num_experts_per_tok``, renormalized if ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

from weight_transfer.model.arch.qwen3 import Qwen3
from weight_transfer.model.arch.shape import ModelShape

_HF_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
)


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    hf_config_class = "Qwen3MoeConfig"
    required_fields = ("num_experts", "moe_intermediate_size")
    experts_field = "num_experts"
    # transformers 5's Qwen3MoeConfig says num_local_experts; the Hub's config.json num_experts
    hf_key_aliases = (("num_local_experts", "num_experts"),)

    def is_moe_layer(self, cfg: ModelShape, layer: int) -> bool:
        return layer not in cfg.mlp_only_layers and (layer + 1) % cfg.decoder_sparse_step == 0

    def hf_fields(self, cfg: ModelShape) -> dict[str, Any]:
        if cfg.num_experts_per_tok is None:
            raise ValueError(f"{cfg.name or 'qwen3_moe'}: num_experts_per_tok is required")
        return {
            **super().hf_fields(cfg),
            **{f: getattr(cfg, f) for f in _HF_MOE_FIELDS},
            "norm_topk_prob": self.norm_topk(cfg),  # the engine's reading of None
            "mlp_only_layers": list(cfg.mlp_only_layers),
        }


QWEN3_MOE = Qwen3Moe()
