"""Qwen2 (``Qwen2ForCausalLM``): Llama with q/k/v biases always and no o_proj bias.

transformers' ``Qwen2Config`` has no ``head_dim``: it is ``hidden_size /
num_attention_heads``, so a config that says otherwise cannot be built.
"""

from __future__ import annotations

from typing import Any

from weight_transfer.model.arch.base import Architecture
from weight_transfer.model.arch.shape import ModelShape


class Qwen2(Architecture):
    name = "qwen2"
    hf_config_class = "Qwen2Config"

    def qkv_bias(self, cfg: ModelShape) -> bool:
        return True

    def o_bias(self, cfg: ModelShape) -> bool:
        return False

    def hf_fields(self, cfg: ModelShape) -> dict[str, Any]:
        if cfg.head_size * cfg.num_attention_heads != cfg.hidden_size:
            raise ValueError(
                f"{cfg.name or 'qwen2'}: head_dim {cfg.head_size} x {cfg.num_attention_heads} "
                f"heads != hidden_size {cfg.hidden_size}; transformers' Qwen2 cannot express it"
            )
        return {}


QWEN2 = Qwen2()
