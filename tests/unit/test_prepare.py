"""prepare_piece: exact destination bytes for copy, zero-padded and FP8 pieces, errors that
name the piece."""

from pathlib import Path

import pytest
import torch

from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.layout.engine_layout import engine_pieces
from weight_transfer.layout.quant import quantize_fp8_blocks
from weight_transfer.model.models import load_model_config
from weight_transfer.sender.prepare import (
    piece_bytes,
    prepare_piece,
    prepare_pieces,
    prepare_pieces_into,
)
from weight_transfer.types import Piece, ShardSpec, Transform

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def piece(rect, *, nbytes=None, dtype="bfloat16", transform=Transform.COPY, size=2):
    n = 1
    for a, b in rect:
        n *= b - a
    return Piece(dst_tensor="engine.t", dst_offset=0, nbytes=nbytes or n * size,
                 dst_dtype=dtype, src_param="trainer.p", src_slice=rect, transform=transform)


def test_copy_casts_and_keeps_the_rectangle():
    full = torch.randn(8, 6)  # fp32 master weights, bf16 engine
    out = prepare_piece(full, piece(((2, 5), (1, 4))))
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out, full[2:5, 1:4].to(torch.bfloat16))


def test_full_rows_of_the_same_dtype_are_not_copied():
    full = torch.randn(8, 6, dtype=torch.bfloat16)
    out = prepare_piece(full, piece(((2, 5), (0, 6))))
    assert out.data_ptr() == full[2].data_ptr()


def test_fp8_weight_and_scale_pieces_of_a_shard():
    cfg = load_model_config(CONFIGS / "tiny_llama.yaml")
    state = random_state_dict(cfg, seed=0)
    pieces = [p for p in engine_pieces(cfg, ShardSpec(tp_rank=1, tp_size=2), fp8=True)
              if p.src_param == "model.layers.0.mlp.down_proj.weight"]
    assert [p.transform for p in pieces] == [Transform.FP8_WEIGHT, Transform.FP8_SCALE]
    full = state["model.layers.0.mlp.down_proj.weight"]  # [256, 512]; rank 1: cols 256..512
    w8, scale = quantize_fp8_blocks(full[:, 256:])
    weight, scales = (prepare_piece(full, p) for p in pieces)
    assert weight.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(weight.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(scales, scale)
    shared = prepare_pieces(full, pieces)
    assert torch.equal(shared[0].view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(shared[1], scales)
    raw = piece_bytes(full, pieces[1])
    assert raw.dtype == torch.uint8 and raw.numel() == pieces[1].nbytes
    assert torch.equal(raw, scale.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    ("p", "message"),
    [
        (piece(((0, 2),)), "expects 1 dimensions"),
        (piece(((0, 9), (0, 6))), r"slice \[0, 9\) of dim 0 lies outside"),
        (piece(((0, 2), (0, 6)), nbytes=5), "prepared 24 B, expected 5"),
        (piece(((0, 2), (0, 6)), dtype="bf16"), "unknown destination dtype"),
        (piece(((0, 2), (0, 6)), dtype="float32", transform=Transform.FP8_WEIGHT),
         "expects float32"),
    ],
)
def test_errors_name_the_piece(p, message):
    with pytest.raises(ValueError, match=message) as info:
        prepare_piece(torch.zeros(8, 6), p)
    assert "trainer.p" in str(info.value) and "engine.t" in str(info.value)


def test_fp8_needs_a_matrix():
    p = piece(((0, 4),), transform=Transform.FP8_WEIGHT, dtype="float8_e4m3fn", size=1)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        prepare_piece(torch.zeros(4), p)


def test_padded_rows_hold_the_rectangle_then_zeros():
    """A rank-3 lora_B [5, 3] into rows 8 wide: one piece, every byte of the 5 x 8 rows."""
    full = torch.randn(5, 3)
    p = piece(((0, 5), (0, 3)), nbytes=5 * 8 * 2, transform=Transform.PAD_COLS)
    want = torch.zeros(5, 8, dtype=torch.bfloat16)
    want[:, :3] = full.to(torch.bfloat16)
    assert torch.equal(prepare_piece(full, p).view(5, 8), want)
    out = torch.full((p.nbytes,), 0xAB, dtype=torch.uint8)  # stale bytes are overwritten
    (ready,) = prepare_pieces_into(full, [p], [out])
    assert torch.equal(ready.view(torch.bfloat16).view(5, 8), want)


@pytest.mark.parametrize("nbytes", [5 * 8 * 2 + 2, 5 * 2 * 2])
def test_padded_rows_of_a_partial_or_narrower_width_are_refused(nbytes):
    p = piece(((0, 5), (0, 3)), nbytes=nbytes, transform=Transform.PAD_COLS)
    with pytest.raises(ValueError, match="no whole number of rows") as info:
        prepare_piece(torch.zeros(5, 3), p)
    assert "trainer.p" in str(info.value)
