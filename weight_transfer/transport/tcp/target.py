"""The target side's table of the ``tcp`` transport: regions, grants, the update window.

Everything a write is checked against, after its frame was authenticated:

- ``grants``: writer identity -> its link key and the regions (by address) the
  plan gave it; written at setup (:meth:`TargetTable.grant`), replaced at the
  next setup (a new key: sessions under the old one are closed by the listener);
- ``regions``: address -> (descriptor, writable bytes) of the regions registered now;
- the update window (``update_window`` option): open between the engine's pause
  for an update and its resume; a write outside it is refused.

:meth:`TargetTable.apply` checks window, region (address and rkey), grant and
bounds, then copies; a refused write writes nothing, is logged and counted. Every
refusal is counted; the log gets at most one line per source (a remote host, or a
writer) per :data:`~weight_transfer.observe.throttle.LOG_EVERY_S`, with the count of
those not logged, so a flood of connections is a few lines, not thousands.
Closing the window or deregistering waits for copies in progress, so nothing is
written after they return.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from weight_transfer.observe.throttle import LogThrottle
from weight_transfer.transport.tcp.wire import (
    NO_WINDOW,
    NOT_GRANTED,
    OK,
    OUT_OF_BOUNDS,
    STATUS_TEXT,
    UNKNOWN_REGION,
    Header,
)
from weight_transfer.types import RegionDesc

log = logging.getLogger(__name__)
REFUSALS_KEPT = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """What one writer identity may do: its link key and the region addresses it may
    write (None: every region of this NIC, for set-ups that give no plan)."""

    key: bytes
    regions: frozenset[int] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """One refused connection or write, for the audit log."""

    at: float
    kind: str  # "connection" or "write"
    peer: str  # the writer identity, or the remote address before authentication
    reason: str


class _Region:
    __slots__ = ("desc", "keepalive", "view")

    def __init__(self, desc: RegionDesc, keepalive: Any) -> None:
        self.desc, self.keepalive = desc, keepalive
        self.view = memoryview((ctypes.c_char * desc.length).from_address(desc.addr)).cast("B")


class TargetTable:
    """See the module docstring; ``label`` names the NIC in messages."""

    def __init__(self, label: str, *, window: bool) -> None:
        self.label = label
        self.regions: dict[int, _Region] = {}
        self.grants: dict[bytes, Grant] = {}
        self.window_enforced = window
        self.window_open = not window
        self.refused_connections = self.refused_writes = 0
        self.bytes_written = self.writes = 0
        self.refusals: collections.deque[Refusal] = collections.deque(maxlen=REFUSALS_KEPT)
        self._cond = threading.Condition()
        self._copying = 0
        self.throttle = LogThrottle()

    # ------------------------------------------------------------------ setup

    def add_region(self, desc: RegionDesc, keepalive: Any) -> None:
        with self._cond:
            self.regions[desc.addr] = _Region(desc, keepalive)

    def remove_region(self, desc: RegionDesc) -> None:
        """Forget a region once no copy into it runs; KeyError if not registered."""
        with self._cond:
            region = self.regions.get(desc.addr)
            if region is None or region.desc != desc:
                raise KeyError(desc.addr)
            del self.regions[desc.addr]
            self._cond.wait_for(lambda: self._copying == 0)

    def grant(self, writer: bytes, grant: Grant) -> Grant | None:
        """Give ``writer`` its key and regions; returns the grant it replaces."""
        with self._cond:
            old = self.grants.get(writer)
            self.grants[writer] = grant
        return old

    def key_for(self, writer: bytes) -> bytes | None:
        with self._cond:
            grant = self.grants.get(writer)
        return None if grant is None else grant.key

    def set_window(self, open_: bool) -> None:
        """Open or close the update window; closing returns once no copy runs."""
        if not self.window_enforced:
            return
        with self._cond:
            self.window_open = open_
            if not open_:
                self._cond.wait_for(lambda: self._copying == 0)

    # ------------------------------------------------------------------ refusals

    def refuse(self, kind: str, peer: str, reason: str, *, source: str = "") -> None:
        """Count one refused connection or write; log it unless its ``source`` (default
        ``peer``) was logged within the throttle's interval."""
        with self._cond:
            if kind == "connection":
                self.refused_connections += 1
            else:
                self.refused_writes += 1
            self.refusals.append(Refusal(at=time.time(), kind=kind, peer=peer, reason=reason))
        skipped = self.throttle.due((kind, source or peer))
        if skipped is None:
            return
        more = (f" ({skipped} more from {source or peer} not logged in the last "
                f"{self.throttle.every_s:g} s)" if skipped else "")
        log.warning("%s refused a %s from %s: %s%s; counted in refused_%ss, logged at most "
                    "once per %g s per source", self.label, kind, peer, reason, more, kind,
                    self.throttle.every_s)

    # ------------------------------------------------------------------ writes

    def _check(self, writer: bytes, h: Header) -> tuple[int, _Region | None]:
        if not self.window_open:
            return NO_WINDOW, None
        region = self.regions.get(h.addr)
        if region is None or region.desc.rkey != h.rkey:
            return UNKNOWN_REGION, None
        grant = self.grants.get(writer)
        if grant is None or (grant.regions is not None and h.addr not in grant.regions):
            return NOT_GRANTED, None
        if h.offset > region.desc.length or h.raw_len > region.desc.length - h.offset:
            return OUT_OF_BOUNDS, None
        return OK, region

    def apply(self, writer: bytes, who: str, h: Header, data: memoryview) -> int:
        """Check and copy one authenticated write; its status (OK: written)."""
        with self._cond:
            status, region = self._check(writer, h)
            if region is not None:
                self._copying += 1
        if region is None:
            self.refuse("write", who, f"write of {h.raw_len} B at offset {h.offset} into "
                        f"region addr={h.addr:#x} rkey={h.rkey:#x}: {STATUS_TEXT[status]}")
            return status
        try:
            region.view[h.offset:h.offset + h.raw_len] = data
        finally:
            with self._cond:
                self._copying -= 1
                self.bytes_written += h.raw_len
                self.writes += 1
                self._cond.notify_all()
        return OK

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"refused_connections": self.refused_connections,
                    "refused_writes": self.refused_writes}
