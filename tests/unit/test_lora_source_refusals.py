"""describe_peft and adapter_tensors refuse, by name and before any collective, a DeepSpeed
ZeRO-3 adapter parameter whose partition they cannot read: one swapped out to NVMe (as
the DeepSpeed source refuses it) and one that carries ``ds_tensor`` but no partition.
The live ZeRO-3 and FSDP2 sources run in tests/integration/test_lora_sources.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft", reason="the `lora` extra (peft) is not installed")

LLAMA = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, vocab_size=128, tie_word_embeddings=False)
NAME = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"


def model_with(**ds):
    """A PEFT model whose one LoRA B carries ZeRO-3's attributes ``ds``, its data empty."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.tools.testkit.lora_oracle import peft_adapter

    torch.manual_seed(0)
    m = peft_adapter(LlamaForCausalLM(LlamaConfig(**LLAMA)), seed=1, r=4)
    p = m.get_parameter(NAME.replace("lora_B.weight", "lora_B.default.weight"))
    for k, v in {"ds_shape": p.shape, **ds}.items():
        setattr(p, k, v)
    p.data = torch.empty(0)
    return m


@pytest.mark.parametrize("part", [
    SimpleNamespace(status="PartitionedParamStatus.NOT_AVAILABLE", final_location="nvme"),
    SimpleNamespace(status="PartitionedParamStatus.AVAILABLE",
                    final_location="OffloadDeviceEnum.nvme"),  # swapped in for now
], ids=["swapped-out", "swapped-in"])
def test_a_partition_on_nvme_is_refused_by_name(part):
    from weight_transfer.sources.lora import adapter_tensors, describe_peft

    m = model_with(ds_tensor=part)
    for call in (describe_peft, adapter_tensors):
        with pytest.raises(ValueError, match=f"{NAME!r} is a ZeRO-3 partition on NVMe"):
            call(m)


def test_a_parameter_without_its_partition_is_refused_by_name():
    from weight_transfer.sources.lora import adapter_tensors, describe_peft

    m = model_with(ds_tensor=None)
    for call in (describe_peft, adapter_tensors):
        with pytest.raises(ValueError, match=f"{NAME!r} is partitioned by DeepSpeed.*no "
                                             r"partition \(ds_tensor is None\)"):
            call(m)
