"""Staging memory registered once: where prepared pieces are written from, every update.

A :class:`StagingArena` is one buffer per trainer rank, allocated, pre-faulted
and registered with the rank's transport at setup, then reused by every update,
so the hot path allocates nothing, registers nothing and touches no fresh page
(a first touch is 25x slower than a warm copy here). One update, per parameter:

1. ``lease = await arena.acquire(nbytes)`` hands out the next byte range of the
   ring, in FIFO order (the ``prepare`` stage runs one parameter at a time, in
   the plan's order); it waits while the ranges of earlier parameters, still
   being written, fill the ring;
2. prepare writes each piece straight into its slice of the lease
   (:func:`piece_slots` gives the aligned offsets);
3. the WRITEs read from the lease; ``arena.release(lease)`` once they are done.

Where the buffer lives: on the GPU when the transport reads device memory
(``transport.supports_device_memory``, rdma with CUDA dma-buf), in pinned host
memory when the parameters are on a GPU that the transport cannot read, else in
huge-page aligned, pre-faulted host memory
(:func:`~weight_transfer.sender.host_memory.alloc_buffer`). The arena is registered once
with ``transport.register_source(buf) -> handle`` and released with
``deregister_source(handle)`` (rdma: one MR for the whole arena instead of one
per write); a transport that needs no registration (simnic) returns None.

A request larger than the whole arena gets a one-off buffer, with a warning:
it is allocated for that parameter and freed after its writes (the watermark
admits such a parameter alone, so it never sits beside the arena's other
ranges). ``oversized`` counts them; size the watermark above the largest
parameter's prepared bytes to keep the hot path free of them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weight_transfer.sender.host_memory import alloc_buffer
from weight_transfer.sender.watermark import BLOCKED, serve_fifo

log = logging.getLogger(__name__)

ALIGN = 256  # every piece starts on this boundary: dtype views and GPU kernels need it


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def piece_slots(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Aligned offsets of consecutive pieces of ``sizes`` bytes, and the bytes they span."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += align_up(n)
    return offsets, end


class RingAllocator:
    """Byte ranges of a ring of ``capacity`` bytes, allocated in order, freed in any order.

    ``alloc`` places a range after the newest live one (or wraps to offset 0) and
    returns its start, or None when it does not fit until older ranges are freed;
    a range is reused only once every range allocated before it is free too.
    Pure bookkeeping: no memory, no waiting.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"ring capacity must be positive, not {capacity}")
        self.capacity = capacity
        self._live: collections.deque[list[int]] = collections.deque()  # [start, end, freed]
        self._open: dict[int, list[int]] = {}  # start -> its entry, for ranges not freed
        self.held = 0

    def alloc(self, nbytes: int) -> int | None:
        if not 0 < nbytes <= self.capacity:
            raise ValueError(f"cannot allocate {nbytes} B from a ring of {self.capacity} B")
        start = self._place(nbytes)
        if start is not None:
            entry = [start, start + nbytes, 0]
            self._live.append(entry)
            self._open[start] = entry  # two ranges not freed never share a start
            self.held += nbytes
        return start

    def _place(self, nbytes: int) -> int | None:
        if not self._live:
            return 0
        oldest, newest = self._live[0][0], self._live[-1]
        if newest[0] >= oldest:  # not wrapped: free space after the newest, then before the oldest
            if newest[1] + nbytes <= self.capacity:
                return newest[1]
            return 0 if nbytes <= oldest else None
        return newest[1] if newest[1] + nbytes <= oldest else None

    def free(self, start: int) -> None:
        entry = self._open.pop(start, None)
        if entry is None:
            raise ValueError(f"no live range starts at {start} of the ring")
        entry[2] = 1
        self.held -= entry[1] - entry[0]
        while self._live and self._live[0][2]:
            self._live.popleft()

    def reset(self) -> None:
        self._live.clear()
        self._open.clear()
        self.held = 0


@dataclass(frozen=True, slots=True)
class Lease:
    """A byte range handed out by the arena: ``buf`` is its uint8 view."""

    start: int
    nbytes: int
    buf: torch.Tensor
    oversized: bool = False


def allocate_staging(nbytes: int, device: torch.device | None, *,
                     pinned: bool = False) -> torch.Tensor:
    """A pre-faulted uint8 buffer of ``nbytes`` on ``device`` (host: 2 MiB aligned and
    advised for huge pages, or pinned when ``pinned``)."""
    if device is not None and device.type == "cuda":
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf.zero_()  # first touch now, not during an update
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).zero_()
    mapping, offset, _ = alloc_buffer(nbytes, fill=None)
    # The tensor holds the memoryview, the memoryview the mapping: freed with the tensor.
    return torch.frombuffer(memoryview(mapping)[offset : offset + nbytes], dtype=torch.uint8)


class StagingArena:
    """See the module docstring."""

    def __init__(self, capacity: int, *, transport: Any = None,
                 device: torch.device | str | None = None, pinned: bool = False,
                 label: str = "") -> None:
        self.device = torch.device(device) if device is not None else None
        self.pinned = pinned
        self.label = label or "staging"
        self.buffer = allocate_staging(capacity, self.device, pinned=pinned)
        self.capacity = capacity
        self.ring = RingAllocator(capacity)
        self.transport = transport
        self.oversized = 0  # one-off buffers handed out for requests larger than the arena
        self.peak = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[int]]] = collections.deque()
        self._handle = transport.register_source(self.buffer) if transport is not None \
            else None
        log.info("%s: %d B arena on %s, %s", self.label, capacity,
                 self.buffer.device, "registered as a source" if self._handle is not None
                 else "no source registration needed")

    async def acquire(self, nbytes: int) -> Lease | None:
        """The next ``nbytes`` of the ring (waits for earlier leases); None for 0 bytes."""
        if nbytes <= 0:
            return None
        if nbytes > self.capacity:
            return self._one_off(nbytes)
        start = self.ring.alloc(nbytes) if not self._waiters else None
        if start is None:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            entry = (nbytes, fut)
            self._waiters.append(entry)
            try:
                start = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self.ring.free(fut.result())
                else:
                    self._waiters.remove(entry)
                self._wake()
                raise
        self.peak = max(self.peak, self.ring.held)
        return Lease(start, nbytes, self.buffer[start : start + nbytes])

    def _one_off(self, nbytes: int) -> Lease:
        self.oversized += 1
        log.warning("%s: %d B to stage exceed the %d B arena: a one-off buffer for this "
                    "parameter (raise the watermark to avoid it)", self.label, nbytes,
                    self.capacity)
        return Lease(-1, nbytes, allocate_staging(nbytes, self.device, pinned=self.pinned),
                     oversized=True)

    def release(self, lease: Lease | None) -> None:
        if lease is None or lease.oversized:
            return
        self.ring.free(lease.start)
        self._wake()

    def _wake(self) -> None:
        serve_fifo(self._waiters, self._try_alloc)

    def _try_alloc(self, nbytes: int) -> object:
        start = self.ring.alloc(nbytes)
        return BLOCKED if start is None else start

    def reset(self) -> None:
        """Forget every lease (after a failed run whose leases were never released)."""
        if self._waiters:
            raise RuntimeError(f"{self.label}: reset while {len(self._waiters)} requests wait")
        self.ring.reset()

    def close(self) -> None:
        """Deregister the arena from the transport (idempotent)."""
        if self._handle is not None:
            self.transport.deregister_source(self._handle)
            self._handle = None


def rank_arena(layouts: Sequence[Sequence[Any]], *, watermark_bytes: int,
               device: torch.device | None, device_memory: bool, transport: Any,
               rank: int) -> StagingArena | None:
    """A rank's arena: ``min(watermark_bytes, the most staged bytes one mesh group needs)``
    (``layouts``: per group, its items' ``BucketLayout``), on the GPU when the parameters
    are there and the NIC reads device memory, pinned when only they are there; None when
    the rank stages nothing."""
    need = max((sum(lay.staged for lay in group) for group in layouts), default=0)
    capacity = min(watermark_bytes, need)
    if capacity <= 0:
        return None
    on_gpu = device is not None and device.type == "cuda"
    return StagingArena(capacity, transport=transport,
                        device=device if on_gpu and device_memory else None,
                        pinned=on_gpu and not device_memory, label=f"rank {rank} staging")
