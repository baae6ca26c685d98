"""Mixtral (``MixtralForCausalLM``): Llama attention without biases, routed experts in every layer.

Names, checked against transformers 5 (``models/mixtral``, its checkpoint
conversion mapping) and vLLM's ``models/mixtral.py``:

* checkpoint (``per_expert`` naming): ``model.layers.{i}.block_sparse_moe.gate.weight``
  ``[E, H]`` and ``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` with w1 = gate
  ``[I, H]``, w3 = up ``[I, H]``, w2 = down ``[H, I]``;
* transformers 5 (``stacked``): the block is ``mlp``: ``mlp.gate.weight`` and the
  3-D ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` (w1 rows, then w3) and
  ``mlp.experts.down_proj`` ``[E, H, I]``;
* vLLM: ``block_sparse_moe.gate.weight`` (replicated) and FusedMoE
  ``block_sparse_moe.experts.w13_weight`` / ``w2_weight``.

``intermediate_size`` is the size of one expert (there is no dense MLP) and
``num_local_experts`` the expert count. Routing: softmax over experts, top
``num_experts_per_tok``, always renormalized.
"""

from __future__ import annotations

from typing import Any

from weight_transfer.model.arch.base import Architecture
from weight_transfer.model.arch.common import MoeKeys
from weight_transfer.model.arch.shape import ModelShape


class Mixtral(Architecture):
    name = "mixtral"
    hf_config_class = "MixtralConfig"
    required_fields = ("num_local_experts", "num_experts_per_tok")
    experts_field = "num_local_experts"
    expert_size_field = "intermediate_size"
    moe_keys = MoeKeys(
        block="block_sparse_moe",
        gate="w1",
        up="w3",
        down="w2",
        order=("w1", "w2", "w3"),
        stacked_block="mlp",
    )

    def check(self, cfg: ModelShape) -> list[str]:
        if cfg.attention_bias:
            return ["attention_bias: mixtral has no attention biases"]
        return []

    def is_moe_layer(self, cfg: ModelShape, layer: int) -> bool:
        return True

    def qkv_bias(self, cfg: ModelShape) -> bool:
        return False

    def o_bias(self, cfg: ModelShape) -> bool:
        return False

    def norm_topk(self, cfg: ModelShape) -> bool:
        return True

    def hf_fields(self, cfg: ModelShape) -> dict[str, Any]:
        return {
            "head_dim": cfg.head_size,
            "num_local_experts": cfg.num_local_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
        }


MIXTRAL = Mixtral()
