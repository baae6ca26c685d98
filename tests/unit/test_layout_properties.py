"""Property: pieces assembled with prepare_piece == the reference loader, byte for byte.

Random tiny configs of every architecture, random TP/EP degrees and ranks, FP8 on
and off, both expert namings, pieces split at random sizes: every engine byte is
written exactly once and equals what ``hf_load.load_engine_shard`` (vLLM-style
narrow/cat/stack, no shared code) produces. Where the layout refuses a shard
(indivisible, or an FP8 block cut), the reference must refuse it too.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.layout.engine_layout import engine_pieces, engine_tensor_specs, split_piece
from weight_transfer.model.models import ModelConfig
from weight_transfer.sender.prepare import as_bytes, piece_bytes
from weight_transfer.types import ShardSpec


@st.composite
def setups(draw):
    arch = draw(st.sampled_from(["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3",
                                 "mixtral"]))
    fp8, tp = draw(st.booleans()), draw(st.sampled_from([1, 2, 4]))
    moe = arch in ("qwen3_moe", "deepseek_v3", "mixtral")
    ep = draw(st.sampled_from([1, 2, 4])) if moe else 1
    unit = 128 if fp8 else 32
    heads = tp * draw(st.integers(1, 2))
    fields = dict(
        architecture=arch,
        hidden_size=draw(st.sampled_from([128, 256] if fp8 else [64, 96, 128])),
        num_hidden_layers=draw(st.integers(1, 2)),
        num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, heads) if heads % k == 0])),
        head_dim=128 if fp8 else draw(st.sampled_from([32, 64])),
        intermediate_size=tp * unit * draw(st.integers(1, 2 if tp < 4 else 1)),
        vocab_size=draw(st.integers(64, 700)),
        tie_word_embeddings=draw(st.booleans()),
    )
    if arch in ("llama", "qwen3"):
        fields["attention_bias"] = draw(st.booleans())
    if moe:
        fields["moe_intermediate_size"] = (tp if ep == 1 else 1) * unit
        experts = ep * draw(st.integers(1, 2))
    if arch == "qwen3_moe":
        fields.update(num_experts=experts, mlp_only_layers=draw(st.sampled_from([(), (0,)])))
    if arch == "mixtral":  # the experts' size is intermediate_size
        fields.update(num_local_experts=experts, num_experts_per_tok=1,
                      intermediate_size=fields.pop("moe_intermediate_size"))
    if arch == "deepseek_v3":
        fields.update(
            num_key_value_heads=heads,
            n_routed_experts=experts,
            n_shared_experts=draw(st.sampled_from([None, 1, 2])),
            first_k_dense_replace=draw(st.integers(0, 1)),
            q_lora_rank=draw(st.sampled_from([None, 128, 256] if fp8 else [None, 64])),
            kv_lora_rank=draw(st.sampled_from([64, 128])),
            qk_nope_head_dim=64,
            qk_rope_head_dim=draw(st.sampled_from([32, 64])),
            v_head_dim=draw(st.sampled_from([64, 128])),
        )
    shard = ShardSpec(tp_rank=draw(st.integers(0, tp - 1)), tp_size=tp,
                      ep_rank=draw(st.integers(0, ep - 1)), ep_size=ep)
    naming = draw(st.sampled_from(["per_expert", "stacked"]))
    max_bytes = draw(st.sampled_from([2000, 40_000, 1 << 30]))
    return ModelConfig(**fields), shard, fp8, naming, max_bytes


def assemble(cfg, state, shard, fp8, naming, max_bytes):
    specs = engine_tensor_specs(cfg, shard, fp8=fp8)
    bufs = {s.name: torch.zeros(s.nbytes, dtype=torch.uint8) for s in specs}
    count = {s.name: np.zeros(s.nbytes, dtype=np.int32) for s in specs}
    for whole in engine_pieces(cfg, shard, fp8=fp8, expert_naming=naming):
        for p in split_piece(whole, max_bytes):
            end = p.dst_offset + p.nbytes
            bufs[p.dst_tensor][p.dst_offset:end] = piece_bytes(state[p.src_param], p)
            count[p.dst_tensor][p.dst_offset:end] += 1
    for name, c in count.items():
        assert (c == 1).all(), f"{name}: bytes covered {set(np.unique(c))} times"
    return specs, bufs


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.slow
@given(setups())
def test_assembled_pieces_equal_the_reference_loader(setup):
    cfg, shard, fp8, naming, max_bytes = setup
    state = random_state_dict(cfg, seed=7, expert_naming=naming)
    try:
        specs, bufs = assemble(cfg, state, shard, fp8, naming, max_bytes)
    except ValueError as exc:
        event("layout refused the shard")
        with pytest.raises(ValueError):
            load_engine_shard(cfg, state, shard, fp8=fp8)
        assert "divisible" in str(exc) or "divide" in str(exc) or "blocks cut" in str(exc)
        return
    event(f"accepted {cfg.architecture}")
    ref = load_engine_shard(cfg, state, shard, fp8=fp8)
    assert set(ref) == {s.name for s in specs}
    for s in specs:
        t = ref[s.name]
        assert (tuple(t.shape), str(t.dtype).removeprefix("torch.")) == (s.shape, s.dtype)
        assert torch.equal(as_bytes(t), bufs[s.name]), s.name
