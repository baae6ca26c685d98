"""The bounded work-request window, driven by a fake NIC that really moves bytes.

``FakeNic`` plays the device: ``post`` queues an RDMA WRITE work request (and
checks the window never exceeds its bound), ``poll`` completes queued requests
in order with ``ctypes.memmove`` - a random number per poll - and, like an RC
QP, after a failed request flushes every later one without writing it.
"""

from __future__ import annotations

import asyncio
import ctypes
import random

import numpy as np
import pytest

from weight_transfer.transport.base import RemoteAccessError, TransportError
from weight_transfer.transport.rdma.errors import IBV_WC_WR_FLUSH_ERR, completion_error
from weight_transfer.transport.rdma.plan import Chunk, split_write
from weight_transfer.transport.rdma.window import Completion, CompletionWindow
from weight_transfer.types import RegionDesc

REM_ACCESS_ERR = 10


class FakeNic:
    def __init__(self, max_inflight: int, seed: int = 0, fail_at: int | None = None):
        self.max_inflight = max_inflight
        self.queue: list[tuple[int, Chunk]] = []
        self.rng = random.Random(seed)
        self.fail_at = fail_at  # index of the posted WR that the target refuses
        self.posted = 0
        self.written = 0
        self.broken = False
        self.hold = False  # while set, poll completes nothing

    def post(self, wr_id: int, chunk: Chunk) -> None:
        assert len(self.queue) < self.max_inflight, "window exceeded its bound"
        self.queue.append((wr_id, chunk))
        self.posted += 1

    def poll(self, max_entries: int) -> list[Completion]:
        if self.hold or not self.queue:
            return []
        n = min(self.rng.randint(0, 3), max_entries, len(self.queue))
        done, self.queue = self.queue[:n], self.queue[n:]
        out = []
        for wr_id, chunk in done:
            index = self.written + len(out)
            if self.broken:
                out.append(Completion(wr_id, IBV_WC_WR_FLUSH_ERR))
            elif index == self.fail_at:
                self.broken = True
                out.append(Completion(wr_id, REM_ACCESS_ERR, vendor_err=0x88))
            else:
                ctypes.memmove(chunk.dst, chunk.src, chunk.length)
                out.append(Completion(wr_id, 0))
        self.written += len(out)
        return out


def buffers(nbytes: int, seed: int = 0):
    src = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    return src, dst


def chunks_of(src: np.ndarray, dst: np.ndarray, chunk: int, offset: int = 0, nbytes=None):
    n = len(src) if nbytes is None else nbytes
    return split_write(src=src.ctypes.data, dst=dst.ctypes.data + offset, nbytes=n,
                       max_bytes=chunk)


@pytest.mark.parametrize("seed", range(4))
def test_bytes_land_and_the_window_stays_bounded(seed):
    nic = FakeNic(max_inflight=4, seed=seed)
    window = CompletionWindow(nic.poll, max_inflight=4)
    src, dst = buffers(1 << 20, seed)

    assert asyncio.run(window.run(chunks_of(src, dst, 4096), nic.post)) is None
    assert np.array_equal(src, dst)
    assert nic.posted == 256
    assert window.peak == 4 and window.inflight == 0


def test_concurrent_writes_share_one_window():
    nic = FakeNic(max_inflight=3, seed=1)
    window = CompletionWindow(nic.poll, max_inflight=3)
    pairs = [buffers(100_000 + i, seed=i) for i in range(5)]

    async def main():
        runs = [window.run(chunks_of(s, d, 7000), nic.post) for s, d in pairs]
        return await asyncio.gather(*runs)

    assert asyncio.run(main()) == [None] * 5
    for s, d in pairs:
        assert np.array_equal(s, d)
    assert window.peak == 3


def test_write_into_the_middle_leaves_the_rest_untouched():
    nic = FakeNic(max_inflight=2)
    window = CompletionWindow(nic.poll, max_inflight=2)
    src, _ = buffers(3000)
    dst = np.full(10_000, 0xEE, dtype=np.uint8)
    asyncio.run(window.run(chunks_of(src, dst, 512, offset=4000), nic.post))
    assert np.array_equal(dst[4000:7000], src)
    assert (dst[:4000] == 0xEE).all() and (dst[7000:] == 0xEE).all()


def test_failed_completion_stops_posting_and_maps_to_remote_access_error():
    nic = FakeNic(max_inflight=4, seed=3, fail_at=10)
    window = CompletionWindow(nic.poll, max_inflight=4)
    src, dst = buffers(64 * 1024)
    chunks = chunks_of(src, dst, 1024)

    failed = asyncio.run(window.run(chunks, nic.post))

    assert failed is not None
    chunk, wc = failed
    assert chunk == chunks[10] and wc.status == REM_ACCESS_ERR
    assert nic.posted <= 10 + 1 + 4  # stopped soon after the failure was seen
    assert np.array_equal(dst[:10 * 1024], src[:10 * 1024])
    assert not dst[10 * 1024:].any()  # nothing after the refused chunk landed
    assert window.inflight == 0
    region = RegionDesc(owner="engine0", nic="mlx5_0", addr=dst.ctypes.data, length=dst.nbytes,
                        rkey=0x77, transport="rdma")
    exc = completion_error(wc.status, peer="engine0", region=region, nbytes=chunk.length,
                           offset=chunk.dst - region.addr, vendor_err=wc.vendor_err)
    assert isinstance(exc, RemoteAccessError)
    assert "1024 B at offset 10240" in str(exc) and "vendor_err=0x88" in str(exc)


def test_a_failing_post_releases_its_slot_and_raises():
    nic = FakeNic(max_inflight=2)
    window = CompletionWindow(nic.poll, max_inflight=2)
    src, dst = buffers(8192)
    calls = []

    def post(wr_id, chunk):
        calls.append(wr_id)
        if len(calls) == 3:
            raise TransportError("ibv_post_send failed: ENOMEM")
        nic.post(wr_id, chunk)

    with pytest.raises(TransportError, match="ENOMEM"):
        asyncio.run(window.run(chunks_of(src, dst, 1024), post))
    assert window.inflight == 0
    assert asyncio.run(window.run(chunks_of(src, dst, 1024), nic.post)) is None  # reusable
    assert np.array_equal(src, dst)


def test_a_dead_completion_queue_fails_every_outstanding_request():
    def poll(_n):
        raise OSError("device removed")

    window = CompletionWindow(poll, max_inflight=4)
    src, dst = buffers(4096)
    with pytest.raises(TransportError, match="polling the completion queue failed: device"):
        asyncio.run(window.run(chunks_of(src, dst, 1024), lambda wr_id, c: None))
    assert window.inflight == 0


def test_cancellation_waits_for_posted_requests_before_returning():
    nic = FakeNic(max_inflight=4)
    nic.hold = True
    window = CompletionWindow(nic.poll, max_inflight=4)
    src, dst = buffers(16 * 1024)
    outstanding_at_cancel_exit = []

    async def main():
        task = asyncio.create_task(window.run(chunks_of(src, dst, 1024), nic.post))
        while nic.posted < 4:  # the window is full: the writer waits for a slot
            await asyncio.sleep(0)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()  # still waiting for the 4 posted requests
        nic.hold = False
        try:
            await task
        except asyncio.CancelledError:
            outstanding_at_cancel_exit.append(len(nic.queue))

    asyncio.run(main())
    assert outstanding_at_cancel_exit == [0]
    assert nic.posted == 4 and window.inflight == 0
    assert np.array_equal(dst[:4096], src[:4096]) and not dst[4096:].any()


def test_window_survives_new_event_loops_and_rejects_bad_bounds():
    nic = FakeNic(max_inflight=2)
    window = CompletionWindow(nic.poll, max_inflight=2)
    for seed in range(3):
        src, dst = buffers(5000, seed)
        assert asyncio.run(window.run(chunks_of(src, dst, 999), nic.post)) is None
        assert np.array_equal(src, dst)
    with pytest.raises(ValueError, match="at least 1"):
        CompletionWindow(nic.poll, max_inflight=0)
