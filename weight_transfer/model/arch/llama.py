"""Llama (``LlamaForCausalLM``): GQA attention, SwiGLU MLP in every layer.

``attention_bias`` adds biases to q/k/v and o alike. Everything else is the
default decoder layer of :class:`~weight_transfer.model.arch.base.Architecture`.
"""

from __future__ import annotations

from weight_transfer.model.arch.base import Architecture


class Llama(Architecture):
    name = "llama"
    hf_config_class = "LlamaConfig"


LLAMA = Llama()
