"""The layout recorded from an engine's loader: op chains to rectangles, strided copies to
pieces, checkpoint names onto trainer parameters, and the planner's checks (pure)."""

from __future__ import annotations

import pytest

from scheduling.build.recorded import recorded_pieces, table_differences
from weight_transfer.layout.recording.slices import copy_pieces, rect_of_chain
from weight_transfer.model.checkpoint_names import to_trainer_pieces
from weight_transfer.model.models import load_model_config
from weight_transfer.types import (
    EngineRankMeta,
    EngineTensorMeta,
    MeshDesc,
    ParamMeta,
    Piece,
    RankInfo,
    RegionDesc,
    ShardSpec,
    TrainerMeta,
)


@pytest.mark.parametrize(("shape", "ops", "rect", "view"), [
    ((1024, 256), [("narrow", (0, 512, 256), ())], ((512, 768), (0, 256)), (256, 256)),
    ((256, 512), [("narrow", (1, 256, 256), ())], ((0, 256), (256, 512)), (256, 256)),
    ((8, 512, 256), [("__getitem__", (3,), ()), ("chunk", (2, 0), ()), ("__getitem__", (1,), ())],
     ((3, 4), (256, 512), (0, 256)), (256, 256)),
    ((10, 4), [("__getitem__", ((slice(2, 6), slice(None)),), ())], ((2, 6), (0, 4)), (4, 4)),
    ((10,), [("unsqueeze", (0,), ()), ("contiguous", (), ())], ((0, 10),), (1, 10)),
])
def test_op_chains_become_rectangles(shape, ops, rect, view):
    assert rect_of_chain(shape, ops) == (rect, view)


def test_transpose_is_refused_naming_the_tensor():
    with pytest.raises(ValueError, match=r"w\.weight: the loader applies transpose"):
        rect_of_chain((4, 4), [("transpose", (0, 1), ())], name="w.weight")


def test_a_strided_destination_splits_into_contiguous_runs():
    pieces = copy_pieces(src="a", rect=((0, 3), (2, 4)), view_shape=(3, 2), dst="b",
                         dst_dtype="float32", offset=2, shape=(3, 2), stride=(4, 1))
    assert [(p.dst_offset, p.nbytes, p.src_slice) for p in pieces] == [
        (8, 8, ((0, 1), (2, 4))), (24, 8, ((1, 2), (2, 4))), (40, 8, ((2, 3), (2, 4)))]


def _piece(dst, off, src, rect, dtype="float32"):
    n = 1
    for a, b in rect:
        n *= b - a
    return Piece(dst_tensor=dst, dst_offset=off, nbytes=4 * n, dst_dtype=dtype, src_param=src,
                 src_slice=rect)


def test_per_expert_checkpoint_names_land_on_stacked_trainer_parameters():
    p = "model.layers.1.mlp.experts"
    pieces = [_piece("w13", 0, f"{p}.3.up_proj.weight", ((0, 4), (0, 8)))]
    out, missing = to_trainer_pieces(pieces, {f"{p}.gate_up_proj": (8, 8, 8)})
    assert missing == []
    assert out[0].src_param == f"{p}.gate_up_proj"
    assert out[0].src_slice == ((3, 4), (4, 8), (0, 8))


def _metas(pieces, tensors, params):
    region = RegionDesc(owner="engine0/tp0", nic="n", addr=4096, length=1 << 20, rkey=1)
    engine = EngineRankMeta(
        replica="engine0", rank=0, node="x", nic="n", shard=ShardSpec(),
        tensors=tuple(EngineTensorMeta(name=n, shape=s, dtype="float32", region=region,
                                       offset=0) for n, s in tensors),
        pieces=tuple(pieces))
    mesh = MeshDesc(ranks=(0,), shape=(1,))
    trainer = TrainerMeta(params=tuple(ParamMeta(name=n, shape=s, dtype="float32", mesh=mesh)
                                       for n, s in params),
                          ranks=(RankInfo(rank=0, node="x", nic="t"),))
    return trainer, [engine]


def test_unmatched_names_are_listed_naming_both_sides():
    pieces = [_piece("qkv", 0, "q.weight", ((0, 2), (0, 2))),
              _piece("qkv", 16, "k.weight", ((0, 2), (0, 2)))]
    trainer, engines = _metas(pieces, [("qkv", (4, 2))], [("q.weight", (2, 2)),
                                                           ("extra.weight", (3,))])
    with pytest.raises(ValueError) as err:
        recorded_pieces(trainer, engines)
    msg = str(err.value)
    assert "engine tensor qkv is filled from checkpoint tensor k.weight" in msg
    assert "trainer parameter extra.weight: the engine consumes none of it" in msg


def test_recorded_pieces_keep_the_trainers_wrapper_names():
    pieces = [_piece("w", 0, "w.weight", ((0, 2),))]
    trainer, engines = _metas(pieces, [("w", (2,))], [("_orig_mod.w.weight", (2,))])
    (got,) = recorded_pieces(trainer, engines)[ShardSpec()]
    assert got.src_param == "_orig_mod.w.weight"


def test_our_tables_cross_check_a_recorded_layout():
    from weight_transfer.layout.engine_layout import engine_pieces

    cfg = load_model_config("configs/models/tiny_llama.yaml")
    table = engine_pieces(cfg, ShardSpec(), fp8=False)
    assert table_differences(cfg, ShardSpec(), table, expert_naming="per_expert") == []
    moved = [p if i else Piece(**{**{f: getattr(p, f) for f in p.__slots__},
                                  "dst_offset": p.dst_offset + p.nbytes})
             for i, p in enumerate(table)]
    assert table_differences(cfg, ShardSpec(), moved, expert_naming="per_expert")


def _spec(name, shape, dtype):
    from weight_transfer.types import TensorSpec

    return TensorSpec(name=name, shape=shape, dtype=dtype)


def test_fp8_checkpoint_pieces_quantize_the_trainers_weight():
    from weight_transfer.layout.recording.fp8 import fp8_pieces
    from weight_transfer.types import Transform

    ckpt = {s.name: s for s in (_spec("q.weight", (384, 256), "float8_e4m3fn"),
                                _spec("q.weight_scale_inv", (3, 2), "float32"),
                                _spec("n.weight", (256,), "bfloat16"))}
    weight = Piece(dst_tensor="qkv.weight", dst_offset=0, nbytes=256 * 256,
                   dst_dtype="float8_e4m3fn", src_param="q.weight",
                   src_slice=((128, 384), (0, 256)))
    scale = Piece(dst_tensor="qkv.weight_scale_inv", dst_offset=0, nbytes=2 * 2 * 4,
                  dst_dtype="float32", src_param="q.weight_scale_inv",
                  src_slice=((1, 3), (0, 2)))
    norm = _piece("n", 0, "n.weight", ((0, 256),), dtype="bfloat16")
    w, s, n = fp8_pieces([weight, scale, norm], ckpt)
    assert (w.transform, w.src_slice) == (Transform.FP8_WEIGHT, weight.src_slice)
    assert (s.transform, s.src_param, s.src_slice) == (
        Transform.FP8_SCALE, "q.weight", ((128, 384), (0, 256)))
    assert n == norm


def test_fp8_pieces_refuse_partial_blocks_and_dequantizing_loaders():
    from weight_transfer.layout.recording.fp8 import fp8_pieces

    ckpt = {"q.weight": _spec("q.weight", (384, 256), "float8_e4m3fn")}
    row = Piece(dst_tensor="qkv.weight", dst_offset=0, nbytes=256, dst_dtype="float8_e4m3fn",
                src_param="q.weight", src_slice=((5, 6), (0, 256)))
    with pytest.raises(ValueError, match=r"q\.weight: the engine takes rows/columns \[5, 6\)"):
        fp8_pieces([row], ckpt)
    wide = Piece(dst_tensor="qkv.weight", dst_offset=0, nbytes=2 * 256 * 384,
                 dst_dtype="bfloat16", src_param="q.weight", src_slice=((0, 384), (0, 256)))
    with pytest.raises(ValueError, match=r"qkv\.weight \(bfloat16\) is filled from FP8 checkpoint"):
        fp8_pieces([wide], ckpt)
