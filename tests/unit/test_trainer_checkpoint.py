"""Checkpoints from any trainer: ``TrainerMixin.wt_save_checkpoint`` writes the attached
model's weights as a Hugging Face checkpoint (what ``save_trainer_checkpoint`` asks every
rank for, and what a vLLM engine starts from), for a user's own trainer class, not only the
ready-made one. No Ray: the mixin's method is called in this process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from actors.trainer import TrainerMixin


class MyTrainer(TrainerMixin):  # a user's trainer: nothing but the mixin and its model
    def __init__(self, model: torch.nn.Module, rank: int = 0, world: int = 1) -> None:
        self.wt_attach(model=model, rank=rank, world=world)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def test_a_users_trainer_saves_a_checkpoint_hugging_face_reads_back(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)  # a trained step, not the init
    assert MyTrainer(model).wt_save_checkpoint(str(tmp_path / "ckpt")) is True
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    want = model.state_dict()
    assert set(saved) == set(want)
    assert all(torch.equal(saved[k], want[k]) for k in want)
    config = AutoConfig.from_pretrained(tmp_path / "ckpt")
    assert config.model_type == "llama" and config.num_hidden_layers == 2
    assert config.architectures == ["LlamaForCausalLM"]  # what vLLM picks its class by
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(loaded.model.layers[0].mlp.up_proj.weight,
                       model.model.layers[0].mlp.up_proj.weight)


def test_only_rank_0_writes(tmp_path):
    assert MyTrainer(tiny_llama(), rank=1, world=2).wt_save_checkpoint(str(tmp_path)) is False
    assert list(tmp_path.iterdir()) == []


def test_a_model_without_a_hugging_face_config_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"trainer rank 0: the attached Linear has no Hugging"):
        MyTrainer(torch.nn.Linear(4, 4)).wt_save_checkpoint(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_before_attach_it_says_to_attach(tmp_path):
    with pytest.raises(RuntimeError, match="call wt_attach"):
        TrainerMixin().wt_save_checkpoint(str(tmp_path))


def test_a_wrapped_model_saves_the_hugging_face_class_under_the_wrapper(tmp_path):
    model = tiny_llama()
    # FSDP2's fully_shard swaps the class for a subclass named FSDP<class>
    model.__class__ = type("FSDPLlamaForCausalLM", (LlamaForCausalLM,), {})
    assert MyTrainer(model).wt_save_checkpoint(str(tmp_path)) is True
    assert AutoConfig.from_pretrained(tmp_path).architectures == ["LlamaForCausalLM"]
