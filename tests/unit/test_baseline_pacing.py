"""The baselines' NIC model: gloo's binomial broadcast tree, the pacer, bucket packing."""

from __future__ import annotations

import time

import pytest

from actors.tools.bench.pacing import NicPacer, bucket_layout, bucket_nbytes, gloo_broadcast_sends


@pytest.mark.parametrize(("size", "sends"), [
    (1, [0]),
    (2, [1, 0]),
    (3, [2, 0, 0]),
    (5, [3, 1, 0, 0, 0]),
    (8, [3, 2, 1, 1, 0, 0, 0, 0]),
])
def test_gloo_binomial_tree_sends(size, sends):
    assert [gloo_broadcast_sends(r, size) for r in range(size)] == sends
    assert sum(sends) == size - 1  # every non-root rank receives exactly once


def test_gloo_tree_with_another_root():
    assert [gloo_broadcast_sends(r, 5, root=2) for r in range(5)] == [0, 0, 3, 1, 0]


def test_pacer_books_both_directions_at_the_cap():
    # Bookings of thousands of seconds: the few microseconds (or, on a loaded machine,
    # milliseconds) between the calls cannot change what is asserted.
    pacer = NicPacer(1.0)  # 1 GB/s
    start = time.monotonic()
    end = pacer.book(tx=3 * 10**12, rx=10**12)  # 3000 s out, 1000 s in, from now
    assert 3000 <= end - start < 3060
    end2 = pacer.book(tx=10**12)
    assert end2 == pytest.approx(end + 1000, abs=1e-6)  # queued behind the first send
    end3 = pacer.book(rx=10**12)
    assert end3 < end2  # the receive side was free 2000 s earlier
    assert pacer.bytes == {"tx": 4 * 10**12, "rx": 2 * 10**12}


def test_uncapped_pacer_counts_only():
    pacer = NicPacer(None)
    assert pacer.book(tx=10**9) <= time.monotonic()
    assert pacer.bytes["tx"] == 10**9
    with pytest.raises(ValueError, match="gbps"):
        NicPacer(0)


def test_bucket_layout_packs_in_order():
    params = [("a", (4,), "bfloat16", 8), ("b", (2,), "bfloat16", 4), ("c", (8,), "bfloat16", 16),
              ("d", (1,), "float32", 4)]
    buckets = bucket_layout(params, 12)
    assert [[e.name for e in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [e.offset for e in buckets[0]] == [0, 8]
    assert [bucket_nbytes(b) for b in buckets] == [12, 16, 4]
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_layout(params, 0)
