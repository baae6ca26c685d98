"""FP8 128x128 block quantization: a hand-computed block, error bounds, sub-block identities."""

import pytest
import torch

from weight_transfer.layout.fp8_geometry import FP8_BLOCK
from weight_transfer.layout.quant import dequantize_fp8_blocks, quantize_fp8_blocks


def test_hand_computed_blocks():
    w = torch.zeros(128, 256)
    w[0, 0], w[5, 7], w[100, 3] = 896.0, -1.5, 3.0  # block (0, 0): amax 896 -> scale 2
    w[7, 130] = -0.25  # block (0, 1): amax 0.25 -> scale 0.25/448
    w8, scale = quantize_fp8_blocks(w)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (128, 256)
    assert scale.dtype == torch.float32 and scale.shape == (1, 2)
    assert scale[0, 0].item() == 2.0
    assert scale[0, 1].item() == pytest.approx(0.25 / 448, rel=1e-7)
    q = w8.float()
    assert (q[0, 0].item(), q[5, 7].item(), q[100, 3].item()) == (448.0, -0.75, 1.5)
    assert q[7, 130].item() == -448.0
    assert torch.count_nonzero(q).item() == 4
    assert torch.equal(dequantize_fp8_blocks(w8, scale)[:, :128], w[:, :128])


def test_all_zero_block_gets_scale_one_and_no_nan():
    w8, scale = quantize_fp8_blocks(torch.zeros(256, 128, dtype=torch.bfloat16))
    assert torch.equal(scale, torch.ones(2, 1))
    assert not torch.isnan(w8.float()).any() and torch.count_nonzero(w8.float()) == 0


def test_partial_edge_blocks():
    w = torch.zeros(130, 200)
    w[129, 199] = 7.0  # alone in block (1, 1)
    w[0, 0] = 1.0
    w8, scale = quantize_fp8_blocks(w)
    assert scale.shape == (2, 2) and w8.shape == (130, 200)
    assert scale[1, 1].item() == pytest.approx(7.0 / 448)
    assert scale[0, 1].item() == 1.0  # empty block
    assert dequantize_fp8_blocks(w8, scale)[129, 199].item() == pytest.approx(7.0)


@pytest.mark.parametrize("seed", range(3))
def test_round_trip_error_is_bounded(seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(384, 300, generator=gen) * torch.logspace(-3, 2, 300)  # mixed magnitudes
    w8, scale = quantize_fp8_blocks(w)
    err = (dequantize_fp8_blocks(w8, scale) - w).abs()
    per_elem = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:384, :300]
    # e4m3: 3 mantissa bits (half ulp 2^-4 relative), subnormal step 2^-9 of the scale
    bound = w.abs() * 2**-4 + per_elem * 2**-10
    assert (err <= bound * (1 + 1e-6)).all()
    assert w8.float().abs().max().item() <= 448.0


def test_aligned_sub_rectangle_gives_the_same_blocks_as_the_whole():
    w = torch.randn(512, 640, dtype=torch.bfloat16)
    w8, scale = quantize_fp8_blocks(w)
    sub8, sub_scale = quantize_fp8_blocks(w[128:384, 256:640])
    assert torch.equal(sub8.view(torch.uint8), w8[128:384, 256:640].view(torch.uint8))
    assert torch.equal(sub_scale, scale[1:3, 2:5])


def test_stacked_3d_is_each_matrix_on_its_own():
    w = torch.randn(3, 256, 200)
    w8, scale = quantize_fp8_blocks(w)
    assert scale.shape == (3, 2, 2)
    for e in range(3):
        one8, one_scale = quantize_fp8_blocks(w[e])
        assert torch.equal(one8.view(torch.uint8), w8[e].view(torch.uint8))
        assert torch.equal(one_scale, scale[e])


def test_deterministic_and_dtype_independent_for_exact_inputs():
    w = torch.randn(256, 256).to(torch.bfloat16)
    a8, a_s = quantize_fp8_blocks(w)
    b8, b_s = quantize_fp8_blocks(w.float())
    assert torch.equal(a8.view(torch.uint8), b8.view(torch.uint8)) and torch.equal(a_s, b_s)


def test_bad_inputs():
    with pytest.raises(ValueError, match="2-D or 3-D"):
        quantize_fp8_blocks(torch.zeros(128))
    with pytest.raises(ValueError, match="block must be positive"):
        quantize_fp8_blocks(torch.zeros(4, 4), block=0)
    w8, _ = quantize_fp8_blocks(torch.ones(256, 256))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_fp8_blocks(w8, torch.ones(1, 2))
