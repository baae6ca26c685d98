"""The reference engine at TP1: vLLM layout in one buffer, logits and tokens of the HF model.

Tolerances: bf16 engines compute in float32 with the same bf16 weights as the
float32 copy of the transformers model, so logits agree to float32 rounding
(measured max |diff| <= 5e-7; asserted < 1e-4) and greedy tokens are equal. An
FP8 engine agrees with the transformers model whose projection weights went
through the same FP8 round trip to float32 rounding (asserted < 1e-4); against
the bf16 model its logits differ by FP8 quantization (measured relative L2
error 4.8-6.7 % on these random models; asserted < 15 %).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_transfer.engines.reference.buffer import TENSOR_ALIGN, EngineBuffer, slot_layout
from weight_transfer.engines.reference.engine import ReferenceEngine
from weight_transfer.engines.reference.hf_model import (
    build_hf_model,
    float_logits,
    fp8_float_copy,
    greedy_generate,
)
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.layout.engine_layout import engine_tensor_specs
from weight_transfer.model.models import ModelConfig, load_model_config
from weight_transfer.sender.host_memory import HUGE_PAGE_SIZE
from weight_transfer.types import ShardSpec

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
TINY_QWEN3 = ModelConfig(
    architecture="qwen3", name="tiny-qwen3", hidden_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
    vocab_size=300, tie_word_embeddings=True, rope_theta=1e6,
)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])
ARCHS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_moe", "tiny_mixtral"]
TP1 = ShardSpec()


def cfg_of(name: str) -> ModelConfig:
    return TINY_QWEN3 if name == "tiny_qwen3" else load_model_config(MODELS / f"{name}.yaml")


def engine_for(cfg: ModelConfig, model, *, fp8: bool = False) -> ReferenceEngine:
    engine = ReferenceEngine(cfg, TP1, fp8=fp8)
    engine.load_state(model.state_dict())
    return engine


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    cfg = cfg_of(request.param)
    return cfg, build_hf_model(cfg, seed=1)


@pytest.mark.slow
def test_bf16_logits_and_tokens_equal_the_hf_model(arch):
    cfg, model = arch
    engine = engine_for(cfg, model)
    diff = (engine.forward(IDS) - float_logits(model, IDS)).abs().max().item()
    assert diff < 1e-4, f"{cfg.name}: max |logit diff| {diff}"
    assert engine.generate(PROMPTS, 6) == greedy_generate(model, PROMPTS, 6)


def test_fp8_weights_are_the_reference_quantization(arch):
    cfg, model = arch
    engine = engine_for(cfg, model, fp8=True)
    want = load_engine_shard(cfg, model.state_dict(), TP1, fp8=True)
    got = engine.state_bytes()
    assert set(got) == set(want)
    assert any(t.dtype == torch.float8_e4m3fn for t in want.values())
    for name, t in want.items():
        assert torch.equal(got[name], t.contiguous().view(torch.uint8).flatten()), name


def test_fp8_logits(arch):
    cfg, model = arch
    logits = engine_for(cfg, model, fp8=True).forward(IDS)
    exact = float_logits(fp8_float_copy(model), IDS)
    assert (logits - exact).abs().max().item() < 1e-4
    bf16 = float_logits(model, IDS)
    rel = ((logits - bf16).norm() / bf16.norm()).item()
    assert 1e-3 < rel < 0.15, f"{cfg.name}: FP8 relative logit error {rel:.4f}"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shard", [TP1, ShardSpec(tp_rank=1, tp_size=2)])
def test_tensors_live_in_one_aligned_buffer(shard, fp8):
    cfg = cfg_of("tiny_moe")
    mem = EngineBuffer(engine_tensor_specs(cfg, shard, fp8=fp8))
    specs = engine_tensor_specs(cfg, shard, fp8=fp8)
    assert [(n, s, d) for n, s, d, _ in mem.specs()] == [(s.name, s.shape, s.dtype) for s in specs]
    base = mem.buffer.data_ptr()
    assert base % HUGE_PAGE_SIZE == 0 and mem.buffer.dtype == torch.uint8
    end = 0
    for name, shape, dtype, offset in mem.specs():
        view = mem.tensors[name]
        assert offset % TENSOR_ALIGN == 0 and offset >= end
        assert view.data_ptr() == base + offset and view.dtype == getattr(torch, dtype)
        assert tuple(view.shape) == shape and mem.offsets[name] == offset
        end = offset + view.numel() * view.element_size()
    assert end <= mem.buffer.numel()


def test_engine_exposes_its_buffer():
    cfg = cfg_of("tiny_moe")
    engine = ReferenceEngine(cfg, TP1, fp8=True)
    assert engine.specs() == EngineBuffer(engine_tensor_specs(cfg, TP1, fp8=True)).specs()
    name = "model.layers.1.mlp.experts.w13_weight"
    assert engine.tensors[name].data_ptr() == engine.buffer.data_ptr() + engine.offsets[name]


def test_slot_layout_refuses_duplicates():
    specs = engine_tensor_specs(cfg_of("tiny_llama"), TP1, fp8=False)
    slots, total = slot_layout(specs)
    assert total == slots[-1].offset + slots[-1].nbytes
    with pytest.raises(ValueError, match=r"model\.norm\.weight is listed twice"):
        slot_layout([*specs, next(s for s in specs if s.name == "model.norm.weight")])


@pytest.mark.slow
def test_bytes_written_into_the_buffer_are_the_weights_used():
    """A weight update is a raw write into the buffer: the next step computes with it."""
    cfg = cfg_of("tiny_moe")
    old, new = build_hf_model(cfg, seed=1), build_hf_model(cfg, seed=2)
    engine = engine_for(cfg, old)
    before = engine.generate(PROMPTS, 6)
    for name, t in load_engine_shard(cfg, new.state_dict(), TP1, fp8=False).items():
        raw = t.contiguous().view(torch.uint8).flatten()
        off = engine.offsets[name]
        engine.buffer[off : off + raw.numel()] = raw
    after = engine.generate(PROMPTS, 6)
    assert after == greedy_generate(new, PROMPTS, 6) and after != before


def test_load_state_checks_names_and_shapes():
    cfg = cfg_of("tiny_llama")
    engine = ReferenceEngine(cfg, TP1, fp8=False)
    state = build_hf_model(cfg, seed=0).state_dict()
    del state["model.norm.weight"]
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        engine.load_state(state)
    other = ModelConfig(**{**cfg.model_dump(), "vocab_size": 960})
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: got \(960, 256\)"):
        engine.load_state(build_hf_model(other, seed=0).state_dict())


def test_refused_configurations():
    with pytest.raises(ValueError, match="'deepseek_v3' is not supported by the reference"):
        ReferenceEngine(load_model_config(MODELS / "tiny_deepseek_v3.yaml"), TP1, fp8=False)
    with pytest.raises(ValueError, match="tp_size=2 needs a process group"):
        ReferenceEngine(cfg_of("tiny_llama"), ShardSpec(tp_rank=0, tp_size=2), fp8=False)
    with pytest.raises(ValueError, match="ep_size == tp_size"):
        ReferenceEngine(cfg_of("tiny_moe"), ShardSpec(ep_rank=0, ep_size=2), fp8=False)
    engine = ReferenceEngine(cfg_of("tiny_llama"), TP1, fp8=False)
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\], not \(3,\)"):
        engine.forward(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"prompt 0: token ids \[1000\]"):
        engine.generate([[1000]], 1)


def test_moe_routing_fields_are_required_and_shared():
    cfg = cfg_of("tiny_moe")
    no_topk = ModelConfig(**{**cfg.model_dump(), "num_experts_per_tok": None})
    with pytest.raises(ValueError, match="num_experts_per_tok is required"):
        ReferenceEngine(no_topk, TP1, fp8=False)
    # norm_topk_prob left out means "off" for the engine and for transformers alike
    plain = ModelConfig(**{**cfg.model_dump(), "norm_topk_prob": None})
    model = build_hf_model(plain, seed=3)
    assert model.config.norm_topk_prob is False
    engine = engine_for(plain, model)
    assert (engine.forward(IDS) - float_logits(model, IDS)).abs().max().item() < 1e-4
