"""The simulated NIC's data path: one WRITE, checked and copied chunk by chunk.

Runs in a worker thread of the writing :class:`~weight_transfer.transport.simnic.nic.SimNic`.
For one write into a connected :class:`Peer`:

1. admit: with the shared lock on the target slot, check the link, the peer's
   liveness, the rkey, the state and the bounds of the WHOLE write; a refused
   write raises before any byte moves;
2. per chunk of ``chunk_bytes``: take fault budget, book the link (bandwidth
   cap), wait for the booked slot, then under the slot's shared lock check the
   rkey/state/link/liveness again and copy with ``process_vm_writev``; the chunk
   counts as delivered when its booked slot ends.

Every error names the region (``RegionDesc.describe()``) and the peer.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weight_transfer.transport.base import (
    LinkDownError,
    PeerUnreachableError,
    RemoteAccessError,
    SourceBuffer,
    TransportError,
)
from weight_transfer.transport.simnic import vm as _vm
from weight_transfer.transport.simnic.link import LinkModel
from weight_transfer.transport.simnic.regtable import LIVE, REVOKING, RemoteTable, SlotView
from weight_transfer.types import RegionDesc

_ADDR_LIMIT = 1 << 64


@dataclass(slots=True)
class Peer:
    """A connected peer NIC (local bookkeeping, never sent anywhere)."""

    label: str
    endpoint: dict[str, Any]
    proc: _vm.ProcessHandle
    table: RemoteTable

    def close(self) -> None:
        self.table.close()
        self.proc.close()


@dataclass(slots=True, kw_only=True)
class DataPath:
    """What the data path needs from its NIC."""

    label: str
    link: LinkModel
    chunk_bytes: int
    wake_fd: int  # readable once the NIC closes: ends waits early
    is_closed: Callable[[], bool]

    def transfer(
        self, peer: Peer, dst: RegionDesc, offset: int, mem: SourceBuffer, abort: threading.Event
    ) -> None:
        """Write all of ``mem`` into ``dst`` at ``offset`` (blocking; call from a worker)."""
        where = f"{dst.describe()} at {peer.label}"
        slot = peer.table.slot_of(dst.rkey)
        with peer.table.handle() as fd:
            remote = self._admit(peer, fd, slot, dst, offset, mem.nbytes, where)
            pos = 0
            while pos < mem.nbytes:
                if abort.is_set():
                    raise TransportError(f"write into {where} cancelled after {pos} B")
                granted = self.link.take(min(self.chunk_bytes, mem.nbytes - pos))
                if granted == 0:
                    raise TransportError(
                        f"injected fault on {self.label}: byte budget used up; the write "
                        f"of {mem.nbytes} B into {where} stopped after {pos} B"
                    )
                start, end = self.link.reserve(granted)
                try:
                    self._sleep_until(peer, start, where)
                    self._chunk(peer, fd, slot, dst, remote + pos, mem.addr + pos, granted, where)
                except BaseException:
                    self.link.refund(granted)
                    raise
                self.link.delivered(granted)
                pos += granted
                self._sleep_until(peer, end, where)

    def _admit(
        self, peer: Peer, fd: int, slot: int, dst: RegionDesc, offset: int, n: int, where: str
    ) -> int:
        """Check the whole write before any byte moves; returns the remote start address."""
        self._check_reachable(peer, where)
        with peer.table.locked(fd, slot) as view:
            _check_slot(view, dst, where)
            lo = dst.addr + offset
            hi = lo + n
            if lo < view.addr or hi > view.addr + view.length or hi > _ADDR_LIMIT:
                raise RemoteAccessError(
                    f"write of {n} B at offset {offset} (address {lo:#x}..{hi:#x}) is outside "
                    f"the registered {view.addr:#x}..{view.addr + view.length:#x} of {where}"
                )
        return lo

    def _chunk(
        self, peer: Peer, fd: int, slot: int, dst: RegionDesc, remote: int, local: int,
        n: int, where: str,
    ) -> None:
        with peer.table.locked(fd, slot) as view:
            _check_slot(view, dst, where)
            self._check_reachable(peer, where)
            try:
                _vm.vm_write(peer.proc.pid, remote, local, n)
            except OSError as e:
                raise _os_error(e, peer, local, n, where) from None

    def _check_reachable(self, peer: Peer, where: str) -> None:
        if self.is_closed():
            raise TransportError(f"{self.label} closed during the write into {where}")
        if not self.link.up:
            raise LinkDownError(f"link of {self.label} is down: cannot reach {where}")
        if not peer.proc.alive():
            raise PeerUnreachableError(f"{peer.label} is dead: cannot write into {where}")
        if peer.table.closed:
            raise PeerUnreachableError(f"{peer.label} closed its NIC: cannot write into {where}")
        if not peer.table.link_up:
            raise LinkDownError(f"link of {peer.label} is down: cannot reach {where}")

    def _sleep_until(self, peer: Peer, deadline: float, where: str) -> None:
        delay = deadline - time.monotonic()
        if delay > 0.002:
            # poll() counts whole milliseconds: wait in it until ~1 ms before the deadline,
            # waking at once if the peer dies or this NIC closes; then sleep precisely.
            if peer.proc.wait_exit(delay - 0.001, self.wake_fd):
                raise PeerUnreachableError(f"{peer.label} exited during the write into {where}")
            if self.is_closed():
                raise TransportError(f"{self.label} closed during the write into {where}")
        rest = deadline - time.monotonic()
        if rest > 0:
            time.sleep(rest)


def _check_slot(view: SlotView, dst: RegionDesc, where: str) -> None:
    if view.rkey != dst.rkey or view.state not in (LIVE, REVOKING):
        raise RemoteAccessError(
            f"no live region with rkey {dst.rkey:#x} (wrong rkey or deregistered): {where}"
        )
    if view.state == REVOKING:
        raise RemoteAccessError(f"region is being deregistered: {where}")


def _os_error(e: OSError, peer: Peer, local: int, n: int, where: str) -> Exception:
    if e.errno == errno.ESRCH:
        return PeerUnreachableError(f"{peer.label} exited during the write into {where}")
    if e.errno == errno.EPERM:
        return PeerUnreachableError(
            f"not permitted to write into {peer.label} (process_vm_writev needs ptrace "
            f"access: same user or root): {where}"
        )
    if e.errno == errno.EFAULT:
        return RemoteAccessError(
            f"bad address: the local source ({local:#x}, {n} B) or the target memory of "
            f"{where} is not mapped"
        )
    return TransportError(f"write into {where} failed: {e}")
