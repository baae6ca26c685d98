"""Qwen3 (``Qwen3ForCausalLM``): Llama with a per-head RMSNorm of q and k before RoPE.

``attention_bias`` adds biases to q/k/v and o, as in Llama.
"""

from __future__ import annotations

from weight_transfer.model.arch.base import Architecture


class Qwen3(Architecture):
    name = "qwen3"
    hf_config_class = "Qwen3Config"
    qk_norm = True


QWEN3 = Qwen3()
