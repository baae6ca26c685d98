"""Bounded window of outstanding work requests, resolved by polling a completion queue.

The RDMA transport posts one signaled work request (WR) per chunk of a write.
:class:`CompletionWindow` allows at most ``max_inflight`` WRs outstanding over
the whole transport (further posts wait for a free slot, in FIFO order), and
polls the completion queue from the event loop without blocking it: a poll
task runs while WRs are outstanding, spinning with ``sleep(0)`` for
``spin_s`` after the last completion, then sleeping ``idle_sleep_s`` between
polls. Several writes may run concurrently; each waits only for its own WRs.

The window knows nothing of verbs: it takes ``post(wr_id, item)`` and
``poll(max_entries) -> [Completion]`` callables, so the same code runs against a
fake NIC in the unit tests and against ``pyverbs`` QPs/CQs on hardware::

    window = CompletionWindow(poll, max_inflight=16)
    failed = await window.run(chunks, post)   # None, or (chunk, completion)
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from weight_transfer.transport.base import TransportError

log = logging.getLogger(__name__)
T = TypeVar("T")
SUCCESS = 0


@dataclass(frozen=True, slots=True)
class Completion:
    """One polled work completion: which WR, its ``ibv_wc_status``, the vendor code."""

    wr_id: int
    status: int
    vendor_err: int = 0


class CompletionWindow(Generic[T]):
    """At most ``max_inflight`` outstanding WRs; completions dispatched by ``wr_id``."""

    def __init__(
        self,
        poll: Callable[[int], Sequence[Completion]],
        *,
        max_inflight: int,
        batch: int = 32,
        spin_s: float = 200e-6,
        idle_sleep_s: float = 100e-6,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, not {max_inflight}")
        self._poll = poll
        self.max_inflight = max_inflight
        self._batch = batch
        self._spin_s = spin_s
        self._idle_sleep_s = idle_sleep_s
        self._free = max_inflight
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._pending: dict[int, asyncio.Future[Completion]] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self.peak = 0  # most WRs ever outstanding at once

    @property
    def inflight(self) -> int:
        return len(self._pending)

    async def run(
        self, items: Sequence[T], post: Callable[[int, T], None]
    ) -> tuple[T, Completion] | None:
        """Post every item as one WR and wait for all; return the first failure or None.

        Posting stops at the first failed completion seen; WRs already posted are
        always waited for (even on cancellation), so their memory may be released
        by the caller as soon as this returns.
        """
        posted: list[tuple[T, asyncio.Future[Completion]]] = []
        checked = 0  # posted[:checked] completed successfully (RC completes in order)
        try:
            for item in items:
                while checked < len(posted) and posted[checked][1].done():
                    if _failed(posted[checked][1]):
                        break
                    checked += 1
                if checked < len(posted) and posted[checked][1].done():
                    break  # a failure: post nothing more
                await self._acquire()
                posted.append((item, self._post_one(item, post)))
        finally:
            await self._drain([fut for _, fut in posted])
        for item, fut in posted:
            completion = fut.result()
            if completion.status != SUCCESS:
                return item, completion
        return None

    def _post_one(self, item: T, post: Callable[[int, T], None]) -> asyncio.Future[Completion]:
        wr_id = next(self._ids)
        fut: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending[wr_id] = fut
        try:
            post(wr_id, item)
        except BaseException:
            del self._pending[wr_id]
            self._release()
            raise
        self.peak = max(self.peak, len(self._pending))
        self._ensure_poller()
        return fut

    async def _drain(self, futs: list[asyncio.Future[Completion]]) -> None:
        if not futs:
            return
        gathered = asyncio.gather(*futs, return_exceptions=True)
        while not gathered.done():
            try:
                await asyncio.shield(gathered)
            except asyncio.CancelledError:
                if gathered.done():
                    raise
                log.warning("write cancelled; waiting for %d posted RDMA WRITEs", len(futs))
                await asyncio.wait(futs)
                raise
        for fut in futs:
            if fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    async def _acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot was handed over just before the cancel
            else:
                self._waiters.remove(fut)
            raise

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over
                return
        self._free += 1

    def _ensure_poller(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        last = time.perf_counter()
        while self._pending:
            try:
                done = self._poll(self._batch)
            except Exception as exc:  # a dead device: fail every outstanding WR
                self._fail_all(TransportError(f"polling the completion queue failed: {exc}"))
                return
            if done:
                for completion in done:
                    self._complete(completion)
                last = time.perf_counter()
                await asyncio.sleep(0)
            elif time.perf_counter() - last < self._spin_s:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(self._idle_sleep_s)

    def _complete(self, completion: Completion) -> None:
        fut = self._pending.pop(completion.wr_id, None)
        if fut is None:
            log.warning("completion for unknown work request %d ignored", completion.wr_id)
            return
        self._release()
        if not fut.done():
            fut.set_result(completion)

    def _fail_all(self, exc: Exception) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            self._release()
            if not fut.done():
                fut.set_exception(exc)


def _failed(fut: asyncio.Future[Completion]) -> bool:
    return fut.exception() is not None or fut.result().status != SUCCESS
