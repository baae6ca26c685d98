"""An asyncio pipeline of stages joined by FIFO queues, under a byte watermark.

Each item passes through every stage in order; each stage has its own FIFO
queue and ``concurrency`` workers, so stages of different items overlap in
time (item 2 is prepared while item 1 is being written). An item enters the
first queue only after it has reserved ``reserve_bytes`` from the watermark,
and gives them back when it leaves the last stage (or fails)::

    pipe = Pipeline([Stage("prepare", prep), Stage("write", write, concurrency=4)],
                    watermark=ByteWatermark(1 << 30))
    results = await pipe.run(items)        # items: PipelineItem(key, reserve_bytes, payload)
    pipe.spans                             # [Span(key, stage, start, end, nbytes)]

A stage with ``concurrency=1`` keeps FIFO order, which stages issuing
collectives (``full_tensor()``) rely on: every rank then issues them in the
order it received the items. The first failure cancels the rest and is raised
with the item's key and stage in the message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from weight_transfer.errors import WeightTransferError
from weight_transfer.sender.watermark import ByteWatermark


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """When one item spent time in one stage (seconds from the pipeline's clock)."""

    key: Any
    stage: str
    start: float
    end: float
    nbytes: int


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    fn: Callable[[Any], Awaitable[Any]]
    concurrency: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"stage {self.name!r}: concurrency must be >= 1")


@dataclass(slots=True, kw_only=True)
class PipelineItem:
    key: Any
    reserve_bytes: int
    payload: Any
    nbytes: int = 0  # bytes this item moves, recorded in its spans
    result: Any = field(default=None, init=False)


class PipelineError(WeightTransferError, RuntimeError):
    """A stage failed for one item; ``__cause__`` is the original error."""


class Pipeline:
    """Stages over FIFO queues; see the module docstring."""

    def __init__(
        self,
        stages: list[Stage],
        *,
        watermark: ByteWatermark | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        self.stages = stages
        self.watermark = watermark
        self.clock = clock
        self.spans: list[Span] = []

    async def run(self, items: Iterable[PipelineItem]) -> list[Any]:
        """Run every item through every stage; returns the last stage's results in input order."""
        items = list(items)
        queues: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in self.stages]
        done: asyncio.Queue[Any] = asyncio.Queue()
        workers: list[asyncio.Task[None]] = []
        for i, stage in enumerate(self.stages):
            nxt = queues[i + 1] if i + 1 < len(self.stages) else done
            for _ in range(stage.concurrency):
                worker = self._worker(stage, queues[i], nxt, done)
                workers.append(asyncio.create_task(worker))
        feeder = asyncio.create_task(self._feed(items, queues[0]))
        try:
            await self._drain(items, done, [feeder, *workers])
        finally:
            for t in (feeder, *workers):
                t.cancel()
            await asyncio.gather(feeder, *workers, return_exceptions=True)
        return [item.result for item in items]

    async def _feed(self, items: list[PipelineItem], first: asyncio.Queue[Any]) -> None:
        for item in items:
            if self.watermark is not None:
                await self.watermark.acquire(item.reserve_bytes)
            await first.put(item)

    async def _worker(
        self, stage: Stage, inbox: asyncio.Queue[Any], outbox: asyncio.Queue[Any],
        done: asyncio.Queue[Any],
    ) -> None:
        while True:
            item = await inbox.get()
            start = self.clock()
            try:
                item.payload = await stage.fn(item.payload)
            except Exception as exc:
                # Straight to the drain: it releases the item's bytes and stops the run.
                await done.put(_Failure(item, stage.name, exc))
                continue
            self.spans.append(
                Span(key=item.key, stage=stage.name, start=start, end=self.clock(),
                     nbytes=item.nbytes)
            )
            await outbox.put(item)

    async def _drain(self, items: list[PipelineItem], done: asyncio.Queue[Any], tasks) -> None:
        remaining = len(items)
        watched = set(tasks)  # the feeder ends normally once every item is in; workers never
        getter = asyncio.ensure_future(done.get())
        try:
            while remaining:
                finished, _ = await asyncio.wait(
                    {getter, *watched}, return_when=asyncio.FIRST_COMPLETED
                )
                for t in finished - {getter}:
                    t.result()  # re-raises if a feeder or worker died outside a stage function
                    watched.discard(t)
                if getter not in finished:
                    continue
                entry = getter.result()
                getter = asyncio.ensure_future(done.get())
                if isinstance(entry, _Failure):
                    self._release(entry.item)
                    raise PipelineError(
                        f"stage {entry.stage!r} failed for item {entry.item.key!r}: {entry.exc}"
                    ) from entry.exc
                entry.result = entry.payload
                self._release(entry)
                remaining -= 1
        finally:
            getter.cancel()

    def _release(self, item: PipelineItem) -> None:
        if self.watermark is not None:
            self.watermark.release(item.reserve_bytes)


@dataclass(frozen=True, slots=True)
class _Failure:
    item: PipelineItem
    stage: str
    exc: BaseException

