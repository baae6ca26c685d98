"""The simulated NIC's link model: bandwidth cap, injected faults and counters.

One :class:`LinkModel` per NIC, shared by all its writes in flight (they run in
worker threads, so everything here is guarded by one lock):

* ``reserve(n)`` books the next ``n / bandwidth`` seconds of the link and returns
  when that slot starts and ends; a chunk is copied at the start and counts as
  delivered at the end, so the NIC never moves more than its cap (plus a burst
  of 1 ms worth of bytes), whatever the number of writes in flight.
* ``take(n)`` grants up to ``n`` bytes of the fault budget set by
  ``fail_after_bytes``: once it is used up, the write that hit it fails.
* ``delivered(n)`` counts bytes that landed.
"""

from __future__ import annotations

import threading
import time

BURST_S = 0.001


class LinkModel:
    def __init__(self, bandwidth_gbps: float | None) -> None:
        self._bytes_per_s = None if bandwidth_gbps is None else bandwidth_gbps * 1e9
        self._next_free = 0.0
        self._budget: int | None = None
        self._mutex = threading.Lock()
        self.up = True
        self.bytes_written = 0
        self.writes = 0
        self.inflight = 0
        self.peak_inflight = 0

    def reserve(self, nbytes: int) -> tuple[float, float]:
        """Book the link for ``nbytes``: (start, end) on the ``time.monotonic`` clock."""
        now = time.monotonic()
        if self._bytes_per_s is None:
            return now, now
        with self._mutex:
            # Up to BURST_S of credit: a chunk that overslept its slot does not push
            # every later slot back, so the long-run rate is the cap, not less.
            start = max(now - BURST_S, self._next_free)
            self._next_free = start + nbytes / self._bytes_per_s
            return start, self._next_free

    def set_bandwidth(self, bandwidth_gbps: float | None) -> None:
        """Re-cap the link (None: uncapped), between writes."""
        with self._mutex:
            self._bytes_per_s = None if bandwidth_gbps is None else bandwidth_gbps * 1e9
            self._next_free = 0.0

    def set_budget(self, nbytes: int | None) -> None:
        with self._mutex:
            self._budget = nbytes

    def take(self, nbytes: int) -> int:
        """Grant up to ``nbytes`` of the fault budget (all of them when none is set)."""
        with self._mutex:
            if self._budget is None:
                return nbytes
            granted = min(nbytes, self._budget)
            self._budget -= granted
            return granted

    def refund(self, nbytes: int) -> None:
        """Give back budget taken for bytes that were never sent."""
        with self._mutex:
            if self._budget is not None:
                self._budget += nbytes

    def delivered(self, nbytes: int) -> None:
        with self._mutex:
            self.bytes_written += nbytes

    def enter(self) -> None:
        with self._mutex:
            self.inflight += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight)

    def leave(self, ok: bool) -> None:
        with self._mutex:
            self.inflight -= 1
            self.writes += int(ok)
