"""describe_peft's global shapes from a parameter's own metadata: a DeepSpeed ZeRO-3
parameter (empty local data) is described by its ``ds_shape``, with no collective; one that
carries a partition but no full shape is refused by name. The live sources run in
tests/integration/test_lora_sources.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="the `lora` extra (peft) is not installed")

LLAMA = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, vocab_size=128, tie_word_embeddings=False)
NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.tools.testkit.lora_oracle import peft_adapter

    torch.manual_seed(0)
    return peft_adapter(LlamaForCausalLM(LlamaConfig(**LLAMA)), seed=1, r=4)


def lora_a(m):
    return m.get_parameter(NAME.replace("lora_A.weight", "lora_A.default.weight"))


def shapes(spec):
    return {p.name: p.shape for p in spec.params}


def test_a_partitioned_parameter_is_described_by_its_full_shape():
    from weight_transfer.sources.lora import describe_peft

    m = model()
    want = describe_peft(m)
    p = lora_a(m)
    p.ds_shape, p.ds_tensor = p.shape, p.data[:2].clone()  # what ZeRO-3 leaves on it
    p.data = torch.empty(0)
    assert describe_peft(m) == want and shapes(want)[NAME] == (4, 64)


def test_a_partition_without_its_full_shape_is_refused_by_name():
    from weight_transfer.sources.lora import adapter_tensors, describe_peft

    m = model()
    p = lora_a(m)
    p.ds_tensor = p.data[:2].clone()
    for call in (describe_peft, adapter_tensors):
        with pytest.raises(ValueError, match=f"{NAME!r} is partitioned by DeepSpeed.*no ds_shape"):
            call(m)
