"""RDMA arithmetic: chunking into work requests, local MR lookup, dma-buf page rounding."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from weight_transfer.transport.rdma.plan import (
    Chunk,
    LocalRegion,
    LocalRegions,
    dmabuf_range,
    split_write,
)


@pytest.mark.parametrize(
    ("nbytes", "max_bytes", "lengths"),
    [
        (0, 8, []),
        (1, 8, [1]),
        (8, 8, [8]),
        (9, 8, [8, 1]),
        (30, 10, [10, 10, 10]),
        (31, 10, [10, 10, 10, 1]),
    ],
)
def test_split_write_examples(nbytes, max_bytes, lengths):
    chunks = split_write(src=1000, dst=5000, nbytes=nbytes, max_bytes=max_bytes)
    assert [c.length for c in chunks] == lengths
    if chunks:
        assert chunks[0] == Chunk(src=1000, dst=5000, length=lengths[0])


@settings(deadline=None)
@given(
    src=st.integers(1, 1 << 48),
    dst=st.integers(0, 1 << 48),
    nbytes=st.integers(0, 1 << 34),
    max_bytes=st.integers(1, 1 << 31),
)
def test_split_write_covers_the_range_once_in_order(src, dst, nbytes, max_bytes):
    assume(nbytes // max_bytes < 2000)
    chunks = split_write(src=src, dst=dst, nbytes=nbytes, max_bytes=max_bytes)
    assert sum(c.length for c in chunks) == nbytes
    pos = 0
    for c in chunks:
        assert 0 < c.length <= max_bytes
        assert (c.src - src, c.dst - dst) == (pos, pos)
        pos += c.length
    assert all(c.length == max_bytes for c in chunks[:-1])


def test_split_write_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        split_write(src=1, dst=0, nbytes=4, max_bytes=0)
    with pytest.raises(ValueError, match="negative number of bytes"):
        split_write(src=1, dst=0, nbytes=-1, max_bytes=4)


def test_local_regions_find_a_covering_mr():
    regions = LocalRegions()
    a = LocalRegion(va=1000, length=100, lkey=1, iova=1000)
    b = LocalRegion(va=1050, length=20, lkey=2, iova=1050)  # inside a
    gpu = LocalRegion(va=10_000, length=4096, lkey=3, iova=512)  # dma-buf MR: iova = offset
    for r in (b, gpu, a):
        regions.add(r)
    assert regions.find(1000, 100) == a
    assert regions.find(1060, 10) in (a, b)
    assert regions.find(1090, 20) is None  # runs past the end of a
    assert regions.find(999, 2) is None
    assert regions.find(1100, 1) is None
    assert regions.find(10_000 + 100, 50) == gpu
    assert gpu.sge_addr(10_000 + 100) == 612
    assert a.sge_addr(1010) == 1010
    regions.remove(a)
    assert regions.find(1000, 100) is None
    assert regions.find(1055, 5) == b
    with pytest.raises(KeyError, match="not registered"):
        regions.remove(a)
    with pytest.raises(ValueError, match="empty"):
        regions.add(LocalRegion(va=1, length=0, lkey=0, iova=1))


@settings(deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 50)), min_size=1, max_size=20),
       probe=st.tuples(st.integers(0, 260), st.integers(1, 60)))
def test_local_regions_find_agrees_with_a_linear_scan(ops, probe):
    regions = LocalRegions()
    all_regions = [LocalRegion(va=va, length=n, lkey=i, iova=va) for i, (va, n) in enumerate(ops)]
    for r in all_regions:
        regions.add(r)
    va, n = probe
    found = regions.find(va, n)
    covering = [r for r in all_regions if r.va <= va and va + n <= r.va + r.length]
    assert (found is None) == (not covering)
    if found is not None:
        assert found in covering


@pytest.mark.parametrize(
    ("ptr", "nbytes", "base", "offset", "span"),
    [
        (0x10000, 4096, 0x10000, 0, 4096),
        (0x10000, 1, 0x10000, 0, 4096),
        (0x10010, 4096, 0x10000, 0x10, 8192),
        (0x10FFF, 2, 0x10000, 0xFFF, 8192),
        (0x7F0000001200, 3 << 20, 0x7F0000001000, 0x200, (3 << 20) + 4096),
    ],
)
def test_dmabuf_range_examples(ptr, nbytes, base, offset, span):
    r = dmabuf_range(ptr, nbytes, 4096)
    assert (r.base, r.offset, r.span) == (base, offset, span)


@settings(deadline=None)
@given(ptr=st.integers(1, 1 << 47), nbytes=st.integers(1, 1 << 30),
       page=st.sampled_from([4096, 16384, 65536]))
def test_dmabuf_range_is_the_smallest_page_aligned_cover(ptr, nbytes, page):
    r = dmabuf_range(ptr, nbytes, page)
    assert r.base % page == 0 and r.span % page == 0
    assert r.base + r.offset == ptr
    assert r.offset + nbytes <= r.span < r.offset + nbytes + page
    assert 0 <= r.offset < page


def test_dmabuf_range_rejects_bad_input():
    with pytest.raises(ValueError, match="power of two"):
        dmabuf_range(4096, 1, 3000)
    with pytest.raises(ValueError, match="bad device range"):
        dmabuf_range(0, 1, 4096)
    with pytest.raises(ValueError, match="bad device range"):
        dmabuf_range(4096, 0, 4096)
