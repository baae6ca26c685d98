"""The time rule of sparse deltas (weight_transfer.delta.policy) and a sender under it: a
rank writes dense when its measured rates say deltas would take longer, probes while a
rate is unknown, keeps probing a share of its pieces while dense, and its kept bytes stay
the bytes it wrote either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weight_transfer.delta.policy import PROBE_SHARE, DeltaRates, busy_seconds
from weight_transfer.sender.delta.send import DeltaDirective, DeltaSender, DeltaSlot
from weight_transfer.types import Piece, RegionDesc


def test_busy_seconds_counts_overlap_once() -> None:
    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4), (3.2, 3.5)]) == pytest.approx(3.0)


def test_choice_from_rates() -> None:
    rates = DeltaRates()
    assert "no dense write rate" in rates.choose(pieces=10, written=200,
                                                 apply_s_per_byte=1e-9, turn=0).reason
    rates.measured_dense(nbytes=50_000_000, seconds=1.0)  # a NIC capped at 0.05 GB/s
    probe = rates.choose(pieces=10, written=200, apply_s_per_byte=None, turn=0)
    assert not probe.delta and probe.reason.startswith("probe")
    rates.measured_encode(seconds=0.1, pieces=100)  # 1 ms per piece diffed and encoded
    fast = rates.choose(pieces=100, written=2 * 10**8, apply_s_per_byte=1e-9, turn=0)
    assert fast.delta and fast.est_delta_s == pytest.approx(0.3)
    assert fast.est_dense_s == pytest.approx(4.0)
    for _ in range(20):  # the NIC gets fast (uncapped): dense wins
        rates.measured_dense(nbytes=10 * 10**9, seconds=1.0)
    slow = rates.choose(pieces=100, written=2 * 10**8, apply_s_per_byte=1e-9, turn=3)
    assert not slow.delta and slow.reason.startswith("dense_time")
    assert sum(slow.probe(i) for i in range(10 * PROBE_SHARE)) == 10


def test_fixed_cost_counts_in_the_estimates() -> None:
    """The time rule's estimates hold each update's fixed cost: the rank's (a delta run's
    wall less its encode CPU; a dense run's less its writes in flight) and the
    controller's (handed over, paid by both); a fixed cost above what deltas save makes the
    rank write dense."""
    rates = DeltaRates(encode_s_per_piece=0.001)
    rates.measured_dense(nbytes=50_000_000, seconds=1.0)
    rates.measured_fixed(run_seconds=0.7, encode_seconds=0.1)  # F_rank 0.6 s
    assert rates.fixed_s == pytest.approx(0.6)
    got = rates.choose(pieces=100, written=2 * 10**8, apply_s_per_byte=1e-9, turn=0,
                       fixed_s=0.2)
    assert got.delta and got.fixed_s == pytest.approx(0.8)
    assert got.est_delta_s == pytest.approx(0.1 + 0.2 + 0.8)
    assert got.est_dense_s == pytest.approx(4.0 + 0.2)
    assert "fixed 0.800 s" in got.reason
    rates.measured_dense_fixed(run_seconds=4.5, write_seconds=4.0)  # a dense run's F_dense
    assert rates.choose(pieces=100, written=2 * 10**8, apply_s_per_byte=1e-9, turn=0,
                        fixed_s=0.2).est_dense_s == pytest.approx(4.0 + 0.5 + 0.2)
    rates.measured_fixed(run_seconds=10.1, encode_seconds=0.1)  # blended: (0.6 + 10) / 2
    assert rates.fixed_s == pytest.approx(5.3)
    dense = rates.choose(pieces=100, written=2 * 10**8, apply_s_per_byte=1e-9, turn=0,
                         fixed_s=0.2)
    assert not dense.delta and dense.reason.startswith("dense_time")


def _sender(rates: DeltaRates, pieces: list[Piece]) -> DeltaSender:
    region = RegionDesc(owner="e/tp0", nic="n", addr=1, length=1 << 20, rkey=1)
    return DeltaSender({"e/tp0": DeltaSlot(region=region, offset=0, size=1 << 20)},
                       rates=rates, written=sum(p.nbytes for p in pieces))


def test_sender_writes_dense_by_time_and_probes() -> None:
    pieces = [Piece(dst_tensor=f"w{i}", dst_offset=0, nbytes=4096, dst_dtype="bfloat16",
                    src_param=f"p{i}", src_slice=((0, 2048),)) for i in range(2 * PROBE_SHARE)]
    rng = np.random.default_rng(0)
    values = {p: rng.integers(0, 256, p.nbytes, dtype=np.uint8) for p in pieces}
    rates = DeltaRates(encode_s_per_piece=1.0, nic_bytes_per_s=1e12)  # dense far faster
    s = _sender(rates, pieces)
    s.begin(DeltaDirective(version=1, anchor=True))
    for p in pieces:
        s.encode(p, torch.from_numpy(values[p]))
    for p in pieces:
        values[p][::97] ^= 1
    s.begin(DeltaDirective(version=2, apply_s_per_byte=1e-9))
    assert s.stats.fallback.startswith("dense_time")
    enc = [s.encode(p, torch.from_numpy(values[p])) for p in pieces]
    st = s.stats
    assert st.time_dense_pieces == len(pieces) - 2  # two probes: still deltas
    assert sum(e.meta is not None for e in enc) == 2
    assert st.diffed_bytes == 2 * 4096
    for p in pieces:  # kept bytes are the new ones either way, at the new version
        assert np.array_equal(s.base[p].data, values[p]) and s.base[p].version == 2
    s.measured(dense_bytes=0, dense_seconds=0.0)
    assert rates.encode_s_per_piece < 1.0  # the probes measured the encode rate again


def test_sender_without_rates_always_sends_deltas() -> None:
    pieces = [Piece(dst_tensor="w", dst_offset=0, nbytes=4096, dst_dtype="bfloat16",
                    src_param="p", src_slice=((0, 2048),))]
    s = DeltaSender({}, rates=None)
    s.begin(DeltaDirective(version=1, anchor=True))
    s.encode(pieces[0], torch.zeros(4096, dtype=torch.uint8))
    s.begin(DeltaDirective(version=2))
    assert s.stats.fallback == ""
    new = torch.zeros(4096, dtype=torch.uint8)
    new[::512] = 1
    assert s.encode(pieces[0], new).meta is not None
