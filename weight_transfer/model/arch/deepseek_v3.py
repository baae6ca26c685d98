"""DeepSeek-V3 (and Kimi-K2, the same architecture): MLA attention, routed + shared experts.

Attention is multi-head latent attention: with ``q_lora_rank`` q goes through
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` and vLLM fuses ``q_a_proj`` with
``kv_a_proj_with_mqa`` into the replicated ``fused_qkv_a_proj``; without it
``q_proj`` is column-parallel. The first ``first_k_dense_replace`` layers are
dense, then every ``moe_layer_freq``-th layer is MoE: router ``mlp.gate.weight``
with a float32 ``e_score_correction_bias`` (``topk_method`` noaux_tc), the
``n_routed_experts`` experts of ``moe_intermediate_size`` and
``n_shared_experts`` shared experts fused into one MLP of
``n_shared_experts * moe_intermediate_size``.

The multi-token-prediction layer (``num_nextn_predict_layers``) is in the
checkpoint but not in the trained model (transformers and vLLM's main model
both skip it), so it is not listed. There is no trainer model builder and the
reference engine does not run MLA: this architecture is planned, loaded by the
reference loader and checked byte for byte, not generated with.
"""

from __future__ import annotations

from weight_transfer.model.arch.base import Architecture
from weight_transfer.model.arch.common import (
    Params,
    Rule,
    Split,
    TrainerParamSpec,
    dense_mlp_params,
    expert_rules,
    expert_specs,
    fused,
    router_rules,
    router_specs,
    same,
    specs,
)
from weight_transfer.model.arch.shape import ModelShape

MLA_Q_LORA = (
    Rule(
        "self_attn.fused_qkv_a_proj.weight",
        fused("self_attn", "fused_qkv_a_proj"),
        Split.REPLICATED,
        fp8=True,
    ),
    same("self_attn.q_a_layernorm.weight", Split.REPLICATED),
    same("self_attn.q_b_proj.weight", Split.COLUMN, fp8=True),
)
MLA_Q_FULL = (
    same("self_attn.q_proj.weight", Split.COLUMN, fp8=True),
    same("self_attn.kv_a_proj_with_mqa.weight", Split.REPLICATED, fp8=True),
)
MLA_KV = (
    same("self_attn.kv_a_layernorm.weight", Split.REPLICATED),
    same("self_attn.kv_b_proj.weight", Split.COLUMN, fp8=True),
    same("self_attn.o_proj.weight", Split.ROW, fp8=True),
)
ROUTER_BIAS = (same("mlp.gate.e_score_correction_bias", Split.REPLICATED, dtype="float32"),)
SHARED_EXPERTS = (
    Rule(
        "mlp.shared_experts.gate_up_proj.weight",
        fused("mlp.shared_experts", "gate_up_proj"),
        Split.COLUMN,
        fp8=True,
    ),
    same("mlp.shared_experts.down_proj.weight", Split.ROW, fp8=True),
)


class DeepseekV3(Architecture):
    name = "deepseek_v3"
    hf_config_class = None  # transformers has one, the demo's builder does not use it
    reference_engine = False  # MLA is not implemented by the reference engine
    required_fields = (
        "n_routed_experts",
        "moe_intermediate_size",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    )
    experts_field = "n_routed_experts"

    def is_moe_layer(self, cfg: ModelShape, layer: int) -> bool:
        return layer >= cfg.first_k_dense_replace and layer % cfg.moe_layer_freq == 0

    def qkv_bias(self, cfg: ModelShape) -> bool:
        return False

    def o_bias(self, cfg: ModelShape) -> bool:
        return False

    def has_router_bias(self, cfg: ModelShape) -> bool:
        return cfg.topk_method in (None, "noaux_tc")

    # ---------------------------------------------------------------- trainer parameters
    def attention_params(self, cfg: ModelShape) -> Params:
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

    def moe_params(self, cfg: ModelShape, layer: int, naming: str) -> list[TrainerParamSpec]:
        out = router_specs(cfg, layer, self.moe_keys, naming)
        p = f"model.layers.{layer}.mlp."
        if self.has_router_bias(cfg):
            out.append(TrainerParamSpec(name=p + "gate.e_score_correction_bias",
                                        shape=(cfg.n_experts,), dtype="float32", layer=layer))
        out += expert_specs(cfg, layer, self.moe_keys, naming)
        if cfg.n_shared_experts:
            inter = cfg.expert_intermediate_size * cfg.n_shared_experts
            shared = dense_mlp_params("shared_experts", cfg.hidden_size, inter)
            out += specs(p, shared, cfg.torch_dtype, layer)
        return out

    # ---------------------------------------------------------------- engine rules
    def attention_rules(self, cfg: ModelShape) -> tuple[Rule, ...]:
        return (MLA_Q_LORA if cfg.q_lora_rank else MLA_Q_FULL) + MLA_KV

    def moe_rules(self, cfg: ModelShape) -> tuple[Rule, ...]:
        bias = ROUTER_BIAS if self.has_router_bias(cfg) else ()
        shared = SHARED_EXPERTS if cfg.n_shared_experts else ()
        return router_rules(self.moe_keys) + bias + expert_rules(self.moe_keys) + shared


DEEPSEEK_V3 = DeepseekV3()
