"""The reference loader on hand-checked shards (it is the oracle the layout tests trust)."""

from pathlib import Path

import pytest
import torch

from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.layout.quant import quantize_fp8_blocks
from weight_transfer.model.models import load_model_config
from weight_transfer.types import ShardSpec

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def cfg(name):
    return load_model_config(CONFIGS / f"{name}.yaml")


def u8(t):
    return t.contiguous().view(torch.uint8)


def test_llama_qkv_shard_with_replicated_kv_heads_and_padded_vocab():
    c = cfg("tiny_llama")
    sd = random_state_dict(c, seed=1)
    out = load_engine_shard(c, sd, ShardSpec(tp_rank=3, tp_size=4), fp8=False)
    a = "model.layers.1.self_attn."
    expect = torch.cat([sd[a + "q_proj.weight"][384:512], sd[a + "k_proj.weight"][128:256],
                        sd[a + "v_proj.weight"][128:256]])
    assert torch.equal(out[a + "qkv_proj.weight"], expect)
    assert torch.equal(out[a + "o_proj.weight"], sd[a + "o_proj.weight"][:, 384:512])
    assert torch.equal(out["lm_head.weight"], sd["lm_head.weight"][768:1000])
    gate_up = out["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up[128:], sd["model.layers.0.mlp.up_proj.weight"][384:512])


def test_qwen2_biases_and_tied_head():
    c = cfg("tiny_qwen2")
    sd = random_state_dict(c, seed=2)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # a state_dict lists the alias
    out = load_engine_shard(c, sd, ShardSpec(tp_rank=1, tp_size=2), fp8=False)
    a = "model.layers.0.self_attn."
    expect = torch.cat([sd[a + "q_proj.bias"][128:], sd[a + "k_proj.bias"],
                        sd[a + "v_proj.bias"]])  # 1 kv head, replicated on both ranks
    assert torch.equal(out[a + "qkv_proj.bias"], expect)
    assert "lm_head.weight" not in out


def test_expert_parallel_rank_holds_its_contiguous_experts():
    c = cfg("tiny_moe")
    sd = random_state_dict(c, seed=3)
    out = load_engine_shard(c, sd, ShardSpec(tp_rank=0, tp_size=2, ep_rank=2, ep_size=4),
                            fp8=False)
    m = "model.layers.1.mlp.experts."
    w13, w2 = out[m + "w13_weight"], out[m + "w2_weight"]
    assert w13.shape == (2, 512, 256) and w2.shape == (2, 256, 256)
    gate, up = sd[m + "4.gate_proj.weight"], sd[m + "4.up_proj.weight"]
    assert torch.equal(w13[0], torch.cat([gate, up]))
    assert torch.equal(w2[1], sd[m + "5.down_proj.weight"])


def test_stacked_and_per_expert_checkpoints_load_the_same_bytes():
    c = cfg("tiny_deepseek_v3")
    per = random_state_dict(c, seed=4)
    stacked = {k: v for k, v in per.items() if ".experts." not in k}
    for i in (1, 2):
        m = f"model.layers.{i}.mlp.experts."
        stacked[m + "gate_up_proj"] = torch.stack([
            torch.cat([per[f"{m}{e}.gate_proj.weight"], per[f"{m}{e}.up_proj.weight"]])
            for e in range(8)])
        stacked[m + "down_proj"] = torch.stack([per[f"{m}{e}.down_proj.weight"] for e in range(8)])
    shard = ShardSpec(tp_rank=1, tp_size=2)
    a = load_engine_shard(c, per, shard, fp8=True)
    b = load_engine_shard(c, stacked, shard, fp8=True)
    assert list(a) == list(b)
    assert all(torch.equal(u8(a[k]), u8(b[k])) for k in a)


def test_fp8_scales_are_narrowed_with_the_weight():
    c = cfg("tiny_deepseek_v3")
    sd = random_state_dict(c, seed=5)
    out = load_engine_shard(c, sd, ShardSpec(tp_rank=1, tp_size=2), fp8=True)
    name = "model.layers.0.self_attn.q_b_proj.weight"  # [512, 256]: rank 1 has rows 256..512
    w8, scale = quantize_fp8_blocks(sd[name])
    assert torch.equal(u8(out[name]), u8(w8[256:]))
    assert torch.equal(out[name + "_scale_inv"], scale[2:])
    fused = out["model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv"]
    assert fused.shape == (2 + 2, 2)  # q_a: 256 rows, kv_a: 128 + 64 rows (partial block)
    assert out["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert out["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("name", "shard", "fp8", "message"),
    [
        ("tiny_deepseek_v3", ShardSpec(tp_rank=0, tp_size=4), True, "cuts an FP8 block"),
        ("tiny_qwen2", ShardSpec(tp_rank=0, tp_size=4), False, "heads over tp=4"),
        ("tiny_moe", ShardSpec(ep_rank=0, ep_size=3), False, "8 experts over ep_size=3"),
    ],
)
def test_impossible_shards_are_errors(name, shard, fp8, message):
    c = cfg(name)
    with pytest.raises(ValueError, match=message):
        load_engine_shard(c, random_state_dict(c, seed=0), shard, fp8=fp8)


def test_unknown_checkpoint_tensors_are_reported():
    c = cfg("tiny_llama")
    sd = random_state_dict(c, seed=0)
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"not loaded: \['model.layers.0.mlp.extra.weight'\]"):
        load_engine_shard(c, sd, ShardSpec(), fp8=False)


def test_mixtral_checkpoint_spelling_w1_gate_w3_up_w2_down():
    c = cfg("tiny_mixtral")  # 4 experts, intermediate_size 256 per expert
    sd = random_state_dict(c, seed=6)  # per_expert: block_sparse_moe.experts.{e}.w1 ...
    out = load_engine_shard(c, sd, ShardSpec(tp_rank=1, tp_size=2), fp8=False)
    m = "model.layers.1.block_sparse_moe."
    w13 = out[m + "experts.w13_weight"]  # rank 1's rows of w1, then of w3
    assert w13.shape == (4, 256, 256)
    assert torch.equal(w13[3, :128], sd[m + "experts.3.w1.weight"][128:])
    assert torch.equal(w13[3, 128:], sd[m + "experts.3.w3.weight"][128:])
    assert torch.equal(out[m + "experts.w2_weight"][3], sd[m + "experts.3.w2.weight"][:, 128:])
    assert torch.equal(out[m + "gate.weight"], sd[m + "gate.weight"])
    fp8 = load_engine_shard(c, sd, ShardSpec(ep_rank=1, ep_size=2), fp8=True)
    assert fp8[m + "experts.w13_weight"].dtype == torch.float8_e4m3fn  # w1/w3 are linears
    assert fp8[m + "experts.w13_weight_scale_inv"].shape == (2, 4, 2)
    assert fp8[m + "gate.weight"].dtype == torch.bfloat16  # the router stays bf16
