"""FP8 deltas from the source weights (weight_transfer.sender.delta.source) and the delta stage's
prepare (weight_transfer.sender.delta.write.DeltaStage.prepare_into): after every step the FP8
bytes and scales are exactly quantize_fp8_blocks' of the new source, the indices returned
are exactly the bytes that changed, including blocks whose scale grew or whose largest
element shrank, partial edge blocks and a rectangle cut out of a larger tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weight_transfer.layout.quant import quantize_fp8_blocks
from weight_transfer.sender.delta.send import DeltaDirective, DeltaSender, DeltaSlot
from weight_transfer.sender.delta.source import MAX_CHANGED, fp8_changes, keep_source, supported
from weight_transfer.sender.delta.write import DeltaStage
from weight_transfer.sender.prepare import prepare_pieces_into
from weight_transfer.types import Piece, RegionDesc, Transform


def _step(g: torch.Generator, full: torch.Tensor, frac: float, spikes: list[tuple]) -> None:
    mask = torch.rand(full.shape, generator=g) < frac
    moved = full.float() + torch.randn(full.shape, generator=g) * 1e-4
    new = torch.where(mask, moved, full.float()).to(full.dtype)
    for r, c, v in spikes:
        new[r, c] = v
    full.copy_(new)


def _bytes(rect: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    q, s = quantize_fp8_blocks(rect)
    return q.view(torch.uint8).reshape(-1).numpy().copy(), s.reshape(-1).numpy().copy()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_changes_equal_a_whole_quantization(seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    rows, cols = [(300, 200), (256, 384), (130, 1000), (128, 128)][seed % 4]
    full = (torch.randn(rows + 9, cols + 5, generator=g) * 0.02).to(dtype)
    rect = full[4 : 4 + rows, 2 : 2 + cols]  # not contiguous
    w8, sc = _bytes(rect)
    kept = keep_source(rect)
    scale_moves = 0
    for step in range(4):
        spikes = [(5, 6, 0.5 + step), (3 + rows, 1 + cols, -0.25 * (step + 1))]
        if step == 3:
            spikes = [(5, 6, 0.0)]  # the largest element of its block shrinks
        _step(g, full, [0.0, 0.002, 0.01, 0.05][step], spikes if seed % 2 else [])
        old_w8, old_sc = w8.copy(), sc.copy()
        got = fp8_changes(kept, rect, w8, sc)
        assert got is not None
        want_w8, want_sc = _bytes(rect)
        assert np.array_equal(w8, want_w8)
        assert np.array_equal(sc.view(np.uint32), want_sc.view(np.uint32))
        assert np.array_equal(got[0], np.flatnonzero(old_w8 != want_w8))
        assert np.array_equal(got[1], np.flatnonzero(old_sc.view(np.uint32)
                                                     != want_sc.view(np.uint32)))
        scale_moves += got[1].size
    if seed % 2:  # the spikes move scales (without them a block's largest may move too)
        assert scale_moves > 0


def test_too_many_changes_touch_nothing() -> None:
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    w8, sc = _bytes(full)
    kept = keep_source(full)
    before = (w8.copy(), sc.copy(), kept.data.copy())
    _step(g, full, 2 * MAX_CHANGED, [])
    assert fp8_changes(kept, full, w8, sc) is None
    for a, b in zip(before, (w8, sc, kept.data), strict=True):
        assert np.array_equal(a, b)


def test_supported_sources() -> None:
    assert supported(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not supported(torch.zeros(4, 4, dtype=torch.float32))  # fp32 masters: all change
    assert not supported(torch.zeros(2, 4, 4, dtype=torch.bfloat16))  # expert stacks


def _fp8_pieces(rows: int, cols: int) -> list[Piece]:
    nr, nc = -(-rows // 128), -(-cols // 128)
    return [Piece(dst_tensor="w", dst_offset=0, nbytes=rows * cols, dst_dtype="float8_e4m3fn",
                  src_param="p", src_slice=((0, rows), (0, cols)),
                  transform=Transform.FP8_WEIGHT),
            Piece(dst_tensor="w_scale_inv", dst_offset=0, nbytes=4 * nr * nc,
                  dst_dtype="float32", src_param="p", src_slice=((0, rows), (0, cols)),
                  transform=Transform.FP8_SCALE),
            Piece(dst_tensor="norm", dst_offset=0, nbytes=2 * cols, dst_dtype="bfloat16",
                  src_param="p", src_slice=((0, 1), (0, cols)))]


def test_stage_prepares_fp8_from_source_changes() -> None:
    g = torch.Generator().manual_seed(11)
    rows, cols = 384, 300
    full = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    param = torch.nn.Parameter(full)  # a trainer's parameter: requires grad, same storage
    pieces = _fp8_pieces(rows, cols)
    region = RegionDesc(owner="engine0/tp0", nic="n", addr=1, length=1 << 20, rkey=1)
    stage = DeltaStage(DeltaSender({"engine0/tp0": DeltaSlot(region=region, offset=0,
                                                              size=1 << 20)}))
    try:
        for version in range(1, 5):
            if version > 1:
                _step(g, full, 0.005, [(1, 1, 0.3 * version)])
            stage.begin(DeltaDirective(version=version, anchor=version == 1))
            outs = [torch.zeros(p.nbytes, dtype=torch.uint8) for p in pieces]
            got = stage.prepare_into(param, pieces, pieces, outs)
            want = prepare_pieces_into(full, pieces,
                                       [torch.zeros(p.nbytes, dtype=torch.uint8)
                                        for p in pieces])
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
            encoded = [stage.sender.encode(p, b) for p, b in zip(pieces, got, strict=True)]
            st = stage.sender.stats
            assert st.source_pieces == (0 if version == 1 else 2)
            if version > 1:
                assert encoded[0].meta is not None  # (the 36 B scale piece: dense)
                assert st.scale_blocks_changed == 1  # the spike's block, every step
            for p, b in zip(pieces, got, strict=True):
                assert np.array_equal(stage.sender.base[p].data, b.numpy())
    finally:
        stage.close()
