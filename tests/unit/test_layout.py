"""Engine layouts: hand-computed shards and pieces, coverage, mapping errors, piece splits."""

import time
from pathlib import Path

import pytest

from weight_transfer.layout.engine_layout import (
    check_mapping,
    engine_pieces,
    engine_tensor_specs,
    split_piece,
)
from weight_transfer.model.models import ModelConfig, load_model_config, trainer_param_specs
from weight_transfer.types import Piece, ShardSpec, Transform

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
BF16 = 2


def cfg(name):
    return load_model_config(CONFIGS / f"{name}.yaml")


def shard(tp_rank=0, tp_size=1, ep_rank=0, ep_size=1):
    return ShardSpec(tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size)


def pieces_of(pieces, tensor):
    return [(p.src_param, p.src_slice, p.dst_offset, p.nbytes) for p in pieces
            if p.dst_tensor == tensor]


def assert_tiles(specs, pieces):
    """Every byte of every tensor covered exactly once (interval arithmetic, no memory)."""
    by_tensor: dict[str, list[Piece]] = {}
    for p in pieces:
        by_tensor.setdefault(p.dst_tensor, []).append(p)
    assert set(by_tensor) == {s.name for s in specs}
    for s in specs:
        end = 0
        for p in sorted(by_tensor[s.name], key=lambda p: p.dst_offset):
            assert p.dst_offset == end, (s.name, p)
            end += p.nbytes
        assert end == s.nbytes, s.name


def test_qkv_shard_is_q_shard_then_replicated_kv_head():
    c = cfg("tiny_llama")  # 4 heads x 128, 2 kv heads; tp=4: kv head r // 2
    ps = engine_pieces(c, shard(2, 4), fp8=False)
    q = "model.layers.0.self_attn.%s_proj.weight"
    row = 256 * BF16
    assert pieces_of(ps, "model.layers.0.self_attn.qkv_proj.weight") == [
        (q % "q", ((256, 384), (0, 256)), 0, 128 * row),
        (q % "k", ((128, 256), (0, 256)), 128 * row, 128 * row),
        (q % "v", ((128, 256), (0, 256)), 256 * row, 128 * row),
    ]
    spec = {s.name: s for s in engine_tensor_specs(c, shard(2, 4), fp8=False)}
    assert spec["model.layers.0.self_attn.qkv_proj.weight"].shape == (384, 256)


def test_row_parallel_cuts_the_input_dim():
    ps = engine_pieces(cfg("tiny_llama"), shard(1, 4), fp8=False)
    assert pieces_of(ps, "model.layers.1.self_attn.o_proj.weight") == [
        ("model.layers.1.self_attn.o_proj.weight", ((0, 256), (128, 256)), 0, 256 * 128 * BF16)
    ]


@pytest.mark.parametrize(("rank", "rows"), [(0, (0, 256)), (2, (512, 768)), (3, (768, 1000))])
def test_vocab_parallel_rows_follow_vllm_padding(rank, rows):
    c = cfg("tiny_llama")  # vocab 1000 -> padded 1024 -> 256 rows per rank of 4
    spec = {s.name: s for s in engine_tensor_specs(c, shard(rank, 4), fp8=True)}
    assert spec["model.embed_tokens.weight"].shape == (rows[1] - rows[0], 256)
    assert spec["lm_head.weight"].dtype == "bfloat16"
    ps = engine_pieces(c, shard(rank, 4), fp8=True)
    assert pieces_of(ps, "lm_head.weight")[0][1] == (rows, (0, 256))


def test_a_rank_holding_only_vocab_padding_has_no_embedding():
    c = cfg("tiny_llama").model_copy(update={"vocab_size": 65})  # padded 128, 32 per rank
    names = {s.name for s in engine_tensor_specs(c, shard(3, 4), fp8=False)}
    assert "model.embed_tokens.weight" not in names
    rows = {s.name: s.shape[0] for s in engine_tensor_specs(c, shard(2, 4), fp8=False)}
    assert rows["model.embed_tokens.weight"] == 1


def test_expert_parallel_pieces_per_expert_and_stacked():
    c = cfg("tiny_moe")  # 8 experts, moe_inter 256, hidden 256; ep=4: rank 1 has 2, 3
    s = shard(1, 2, 1, 4)
    w13 = "model.layers.1.mlp.experts.w13_weight"
    expert = 256 * 256 * BF16
    per = engine_pieces(c, s, fp8=False)
    e = "model.layers.1.mlp.experts.%d.%s_proj.weight"
    assert pieces_of(per, w13) == [
        (e % (2, "gate"), ((0, 256), (0, 256)), 0, expert),
        (e % (2, "up"), ((0, 256), (0, 256)), expert, expert),
        (e % (3, "gate"), ((0, 256), (0, 256)), 2 * expert, expert),
        (e % (3, "up"), ((0, 256), (0, 256)), 3 * expert, expert),
    ]
    stacked = engine_pieces(c, s, fp8=False, expert_naming="stacked")
    assert pieces_of(stacked, w13) == [
        ("model.layers.1.mlp.experts.gate_up_proj", ((2, 4), (0, 512), (0, 256)), 0, 4 * expert)
    ]
    spec = {t.name: t for t in engine_tensor_specs(c, s, fp8=False)}
    assert spec[w13].shape == (2, 512, 256)
    assert spec["model.layers.1.mlp.experts.w2_weight"].shape == (2, 256, 256)


def test_experts_without_ep_are_tp_sharded_on_the_intermediate_dim():
    c = cfg("tiny_moe")
    ps = engine_pieces(c, shard(1, 2), fp8=False, expert_naming="stacked")
    gate_up = "model.layers.2.mlp.experts.gate_up_proj"
    w13 = pieces_of(ps, "model.layers.2.mlp.experts.w13_weight")
    assert w13[:2] == [
        (gate_up, ((0, 1), (128, 256), (0, 256)), 0, 128 * 256 * BF16),
        (gate_up, ((0, 1), (384, 512), (0, 256)), 128 * 256 * BF16, 128 * 256 * BF16),
    ]
    assert pieces_of(ps, "model.layers.2.mlp.experts.w2_weight") == [
        ("model.layers.2.mlp.experts.down_proj", ((0, 8), (0, 256), (128, 256)), 0,
         8 * 256 * 128 * BF16)
    ]


def test_fp8_weight_and_scale_pieces_share_the_source_rectangle():
    c = cfg("tiny_llama")
    ps = engine_pieces(c, shard(1, 2), fp8=True)
    spec = {s.name: s for s in engine_tensor_specs(c, shard(1, 2), fp8=True)}
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert spec[qkv].dtype == "float8_e4m3fn"
    assert spec[qkv + "_scale_inv"].shape == (4, 2)  # q: 2 blocks, k: 1, v: 1; 256 cols
    weights = [p for p in ps if p.dst_tensor == qkv]
    scales = [p for p in ps if p.dst_tensor == qkv + "_scale_inv"]
    assert [p.transform for p in weights] == [Transform.FP8_WEIGHT] * 3
    assert [p.src_slice for p in weights] == [p.src_slice for p in scales]
    assert [(p.dst_offset, p.nbytes) for p in scales] == [(0, 16), (16, 8), (24, 8)]
    assert [(p.dst_offset, p.nbytes) for p in weights] == [(0, 65536), (65536, 32768),
                                                          (98304, 32768)]


@pytest.mark.parametrize(
    ("name", "s", "message"),
    [
        ("tiny_moe", shard(0, 4), "blocks cut .*w13_weight"),
        ("tiny_mixtral", shard(0, 4), "blocks cut .*block_sparse_moe.experts.w13_weight"),
        ("tiny_deepseek_v3", shard(1, 4), "blocks cut .*kv_b_proj"),
    ],
)
def test_fp8_cut_inside_a_block_is_an_error_naming_the_tensor(name, s, message):
    with pytest.raises(ValueError, match=message):
        engine_pieces(cfg(name), s, fp8=True)
    engine_pieces(cfg(name), s, fp8=False)  # the same cut in bf16 is fine


@pytest.mark.parametrize(
    ("name", "s", "message"),
    [
        ("tiny_qwen2", shard(0, 4), "num_attention_heads=2"),
        ("tiny_moe", shard(0, 1, 0, 3), "ep_size=3 does not divide 8 experts"),
        ("tiny_mixtral", shard(0, 1, 0, 3), "ep_size=3 does not divide 4 experts"),
        ("tiny_llama", shard(0, 8), "num_attention_heads=4"),
    ],
)
def test_indivisible_shards_are_errors(name, s, message):
    with pytest.raises(ValueError, match=message):
        engine_tensor_specs(cfg(name), s, fp8=False)


@pytest.mark.parametrize(
    ("name", "tp", "ep", "fp8"),
    [("tiny_llama", 4, 1, True), ("tiny_qwen2", 2, 1, True), ("tiny_moe", 2, 4, True),
     ("tiny_moe", 4, 1, False), ("tiny_deepseek_v3", 2, 8, True),
     ("tiny_deepseek_v3", 4, 1, False), ("tiny_mixtral", 2, 1, True),
     ("tiny_mixtral", 2, 2, True), ("tiny_mixtral", 4, 4, False)],
)
@pytest.mark.parametrize("naming", ["per_expert", "stacked"])
def test_every_byte_covered_exactly_once(name, tp, ep, fp8, naming):
    c = cfg(name)
    for r in range(max(tp, ep)):
        s = shard(r % tp, tp, r % ep, ep)
        assert_tiles(engine_tensor_specs(c, s, fp8=fp8),
                     engine_pieces(c, s, fp8=fp8, expert_naming=naming))


def test_ignored_engine_tensors_are_dropped():
    c = cfg("tiny_llama")
    ignore = ["lm_head.weight", "*.qkv_proj.weight"]
    specs = engine_tensor_specs(c, shard(), fp8=True, ignore=ignore)
    names = {s.name for s in specs}
    assert "lm_head.weight" not in names
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" not in names
    assert_tiles(specs, engine_pieces(c, shard(), fp8=True, ignore=ignore))


def names_of(c: ModelConfig, naming="per_expert"):
    return [s.name for s in trainer_param_specs(c, expert_naming=naming)]


def test_check_mapping_lists_both_directions():
    c = cfg("tiny_moe")
    names = names_of(c)
    names.remove("model.layers.2.self_attn.k_proj.weight")
    names.remove("model.layers.1.mlp.experts.5.up_proj.weight")
    names += ["model.layers.0.mlp.extra.weight", "model.vision.proj"]
    with pytest.raises(ValueError) as info:
        check_mapping(c, fp8=False, expert_naming="per_expert", trainer_names=names,
                      tp_size=2, ep_size=2)
    msg = str(info.value)
    assert "2 trainer parameters without a destination" in msg
    assert "model.layers.0.mlp.extra.weight" in msg and "model.vision.proj" in msg
    assert "2 engine tensors without a source" in msg
    assert "model.layers.2.self_attn.qkv_proj.weight (missing " in msg
    assert "model.layers.1.mlp.experts.w13_weight (missing " in msg


def test_check_mapping_ignore_patterns_and_wrapper_prefixes():
    c = cfg("tiny_moe")
    names = ["_orig_mod." + n for n in names_of(c) if "lm_head" not in n] + ["model.vision.x"]
    check_mapping(c, fp8=True, expert_naming="per_expert", trainer_names=names, tp_size=2,
                  ep_size=8, ignore=["model.vision.*", "lm_head.weight"])
    ignoring = c.model_copy(update={"ignore_params": ("model.vision.*", "lm_head.*")})
    check_mapping(ignoring, fp8=True, expert_naming="per_expert", trainer_names=names,
                  tp_size=2, ep_size=8)


def test_check_mapping_with_the_wrong_expert_naming_lists_every_expert():
    c = cfg("tiny_moe")
    with pytest.raises(ValueError) as info:
        check_mapping(c, fp8=False, expert_naming="per_expert",
                      trainer_names=names_of(c, "stacked"), tp_size=1, ep_size=1)
    msg = str(info.value)
    assert "4 trainer parameters without a destination" in msg  # 2 layers x 2 stacked
    assert "model.layers.2.mlp.experts.gate_up_proj" in msg
    assert msg.count("mlp.experts.7.down_proj.weight") == 2


def test_check_mapping_reports_layout_problems():
    c = cfg("tiny_moe")
    with pytest.raises(ValueError, match="blocks cut"):
        check_mapping(c, fp8=True, expert_naming="stacked", trainer_names=names_of(c, "stacked"),
                      tp_size=4, ep_size=1)


def copy_piece(rows, cols=64, start=0):
    return Piece(dst_tensor="t", dst_offset=1000, nbytes=rows * cols * BF16, dst_dtype="bfloat16",
                 src_param="p", src_slice=((start, start + rows), (0, cols)))


def test_split_copy_piece_by_whole_rows():
    parts = split_piece(copy_piece(10, start=5), max_bytes=3 * 64 * BF16 + 7)
    assert [p.src_slice[0] for p in parts] == [(5, 8), (8, 11), (11, 14), (14, 15)]
    assert [p.dst_offset for p in parts] == [1000 + i * 3 * 128 for i in range(4)]
    assert sum(p.nbytes for p in parts) == 10 * 128
    rows = split_piece(copy_piece(10), max_bytes=10)  # never below one row
    assert [p.src_slice for p in rows] == [((i, i + 1), (0, 64)) for i in range(10)]
    assert split_piece(copy_piece(4), max_bytes=1 << 20) == [copy_piece(4)]
    with pytest.raises(ValueError, match="positive"):
        split_piece(copy_piece(4), 0)


def test_split_fp8_pieces_on_block_boundaries_consistently():
    c = cfg("tiny_llama")
    ps = engine_pieces(c, shard(), fp8=True)
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    weight = next(p for p in ps if p.dst_tensor == gate_up)  # gate: 512 x 256
    scale = next(p for p in ps if p.dst_tensor == gate_up + "_scale_inv")
    parts = split_piece(weight, max_bytes=200 * 256)
    assert [p.src_slice[0] for p in parts] == [(0, 128), (128, 256), (256, 384), (384, 512)]
    sparts = split_piece(scale, max_bytes=9)  # one block row of scales: 2 x 4 bytes
    assert [p.src_slice[0] for p in sparts] == [p.src_slice[0] for p in parts]
    assert [(p.dst_offset, p.nbytes) for p in sparts] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert split_piece(weight, max_bytes=1) == parts  # never below one block


def test_split_3d_experts_by_expert_first():
    c = cfg("tiny_moe")
    ps = engine_pieces(c, shard(), fp8=True, expert_naming="stacked")
    w13 = next(p for p in ps if p.dst_tensor.endswith("layers.1.mlp.experts.w13_weight"))
    parts = split_piece(w13, max_bytes=3 * 512 * 256)
    assert [p.src_slice[0] for p in parts] == [(0, 3), (3, 6), (6, 8)]
    assert [p.dst_offset for p in parts] == [0, 3 * 512 * 256, 6 * 512 * 256]


@pytest.mark.slow
def test_kimi_k2_layout_at_scale():
    c = cfg("kimi_k2")
    engine_pieces(c, shard(0, 16, 0, 16), fp8=True)  # warm the per-config caches
    start = time.perf_counter()
    total = 0
    for r in range(16):
        total += len(engine_pieces(c, shard(r, 16, r, 16), fp8=True))
    elapsed = time.perf_counter() - start
    print(f"kimi_k2 engine_pieces, 16 ranks (tp16/ep16, fp8): {total} pieces in {elapsed:.2f} s")
    specs = engine_tensor_specs(c, shard(5, 16, 5, 16), fp8=True)
    assert_tiles(specs, engine_pieces(c, shard(5, 16, 5, 16), fp8=True))
    w13 = next(s for s in specs if s.name == "model.layers.1.mlp.experts.w13_weight")
    assert (w13.shape, w13.dtype) == ((24, 4096, 7168), "float8_e4m3fn")
    check_mapping(c, fp8=True, expert_naming="stacked", trainer_names=names_of(c, "stacked"),
                  tp_size=16, ep_size=16)
