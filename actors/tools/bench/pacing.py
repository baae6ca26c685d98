"""NIC pacing and bucket layout for the baseline weight-update designs (pure: no Ray).

``wt bench designs`` compares our point-to-point plan with the common designs
(rank-0 gather + broadcast, per-tensor RPC, bucketed broadcast). Ours sends
through simnic, whose NICs cap bandwidth; the baselines send through gloo or
Ray, which know no caps. So that every design pays the same NICs, each
baseline process paces what it actually moves with a :class:`NicPacer`:

* one NIC per process, full duplex: a transmit and a receive token bucket,
  both at the simnic cap (GB/s, 1 GB/s = 1e9 B/s), the same booking rule as
  simnic's link model (a transfer starts when the bucket is free, lasts
  ``bytes / cap``);
* a collective books, when it starts, the bytes this process sends and
  receives in it, and the process sleeps after the collective until both
  bookings ended: an operation never finishes faster than its NIC allows.
  Booking at the start is slightly generous to the baselines (a forwarding
  rank of a tree may overlap its receive and its send);
* gloo's broadcast (``gloo/broadcast.cc``, what ``ProcessGroupGloo.broadcast``
  runs) is a binomial tree: with ``n`` ranks the root sends the whole tensor
  ``ceil(log2 n)`` times and some receivers forward it;
  :func:`gloo_broadcast_sends` says how many times each rank sends, and that
  is what each process paces (root included), not a flat one-to-all;
* gathers among the trainer ranks (``full_tensor()``) are the same gloo
  collective in every design, ours included, and are not paced in any.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass


def gloo_broadcast_sends(rank: int, size: int, root: int = 0) -> int:
    """How many times ``rank`` sends the whole buffer in gloo's binomial-tree broadcast."""
    if not (0 <= rank < size and 0 <= root < size):
        raise ValueError(f"rank {rank} / root {root} outside a group of {size}")
    vrank = (rank - root) % size
    dim = max(1, math.ceil(math.log2(size))) if size > 1 else 0
    mask, sends = (1 << dim) - 1, 0
    for i in range(dim):
        mask ^= 1 << i
        if vrank & mask:
            continue
        if (vrank ^ (1 << i)) < size and not vrank & (1 << i):
            sends += 1
    return sends


class NicPacer:
    """Token buckets of one full-duplex NIC capped at ``gbps`` (None: no cap)."""

    def __init__(self, gbps: float | None) -> None:
        if gbps is not None and not gbps > 0:
            raise ValueError(f"NicPacer: gbps must be None or > 0, not {gbps!r}")
        self.gbps = gbps
        self._free = {"tx": 0.0, "rx": 0.0}
        self._mutex = threading.Lock()
        self.bytes = {"tx": 0, "rx": 0}

    def book(self, *, tx: int = 0, rx: int = 0) -> float:
        """Book ``tx`` bytes out and ``rx`` bytes in from now; returns when both end."""
        now = time.monotonic()
        with self._mutex:
            self.bytes["tx"] += tx
            self.bytes["rx"] += rx
            if self.gbps is None:
                return now
            end = now
            for side, n in (("tx", tx), ("rx", rx)):
                if n:
                    self._free[side] = max(now, self._free[side]) + n / (self.gbps * 1e9)
                    end = max(end, self._free[side])
            return end

    @staticmethod
    def wait_until(deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketEntry:
    """One parameter packed into a bucket: name, byte offset, shape, dtype name."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def bucket_layout(params: list[tuple[str, tuple[int, ...], str, int]],
                  bucket_bytes: int) -> list[list[BucketEntry]]:
    """Pack ``(name, shape, dtype, nbytes)`` in order into buckets of at most
    ``bucket_bytes`` (a larger parameter gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, not {bucket_bytes}")
    buckets: list[list[BucketEntry]] = []
    used = bucket_bytes
    for name, shape, dtype, nbytes in params:
        if used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(BucketEntry(name=name, offset=used, shape=tuple(shape), dtype=dtype,
                                       nbytes=nbytes))
        used += nbytes
    return buckets


def bucket_nbytes(bucket: list[BucketEntry]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes if bucket else 0
