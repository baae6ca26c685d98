"""An asyncio semaphore counted in bytes: the memory watermark of the pipeline.

A task reserves the temporary bytes it will hold (gathered tensor, prepared
buffer) before it enters the pipeline and releases them when it leaves::

    wm = ByteWatermark(limit=2 << 30)
    async with wm.reserve(nbytes):
        ...  # at most `limit` bytes are reserved at any moment

Admission is FIFO (a large task at the head is not starved by small ones that
arrive later), and a single reservation larger than the limit is admitted once
nothing else is held, so it runs alone instead of deadlocking. ``peak`` records
the largest total ever held, for tests and reports. :class:`WatermarkGauge` records
what it holds as a metric during a run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

BLOCKED = object()  # what a grant function returns when the head of the queue must wait


def serve_fifo(waiters: collections.deque, try_grant: Callable[[int], object]) -> None:
    """Grant queued ``(nbytes, future)`` requests in arrival order, skipping cancelled
    ones, while ``try_grant(nbytes)`` admits the head; its result becomes the future's
    value. Stops at the first request that gets :data:`BLOCKED` (strict FIFO: no overtaking).
    Shared by the watermark and the staging arena."""
    while waiters:
        nbytes, fut = waiters[0]
        if fut.done():
            waiters.popleft()
            continue
        result = try_grant(nbytes)
        if result is BLOCKED:
            return
        waiters.popleft()
        fut.set_result(result)

class ByteWatermark:
    """FIFO byte budget; see the module docstring."""

    def __init__(self, limit: int, *, on_change: Callable[[int], None] | None = None) -> None:
        if limit <= 0:
            raise ValueError(f"watermark limit must be positive, got {limit}")
        self.limit = limit
        self.on_change = on_change  # called with the bytes held after each grant and release
        self.held = 0
        self.peak = 0
        self.oversized = 0  # reservations admitted alone because they exceed the limit
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, nbytes: int) -> bool:
        if nbytes > self.limit:
            return self.held == 0
        return self.held + nbytes <= self.limit

    def _grant(self, nbytes: int) -> None:
        if nbytes > self.limit:
            self.oversized += 1
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        if self.on_change is not None:
            self.on_change(self.held)

    async def acquire(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative number of bytes ({nbytes})")
        if not self._waiters and self._fits(nbytes):
            self._grant(nbytes)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(nbytes)  # granted just before the cancel landed
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, nbytes: int) -> None:
        if nbytes > self.held:
            raise RuntimeError(f"watermark release of {nbytes} B exceeds the {self.held} B held")
        self.held -= nbytes
        if self.on_change is not None:
            self.on_change(self.held)
        self._wake()

    def _wake(self) -> None:
        serve_fifo(self._waiters, self._try_grant)

    def _try_grant(self, nbytes: int) -> object:
        if not self._fits(nbytes):
            return BLOCKED
        self._grant(nbytes)
        return None

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        await self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)


class WatermarkGauge:
    """Records the bytes a rank's watermark holds in ``metrics`` (a TransferMetrics, or None:
    nothing) at most every ``every_s`` (a change per bucket and stage; a record costs 0.1 ms
    through Ray's metrics), and at the end of a run (``last``)."""

    def __init__(self, metrics: Any, *, rank: int, every_s: float = 0.05) -> None:
        self.metrics, self.rank, self.every_s = metrics, rank, every_s
        self._at = float("-inf")  # when the gauge was last recorded

    def __call__(self, held: int, *, last: bool = False) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        if last or now - self._at >= self.every_s:
            self._at = now
            self.metrics.watermark_in_use(rank=self.rank, nbytes=held)
