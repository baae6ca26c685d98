"""The simulated NIC's region table: shared memory a remote writer checks on its own.

The owner NIC creates the table in a ``memfd`` and is the only one that changes
it. A writer on the same host opens ``/proc/<owner pid>/fd/<table fd>`` (the
owner runs no code for that), maps it read-only and, before every chunk it
writes, takes a shared lock on the slot of the target region and checks the
slot's rkey, bounds and state. Deregistering marks the slot ``REVOKING``
(new chunks stop), then takes the exclusive lock on the slot (waits for the
chunks in flight), then frees it: once :meth:`RegionTable.revoke` returns, no
later write lands.

Layout (little endian)::

    header (64 B): magic "SIMNIC01", version u32, nslots u32, nonce 16 B,
                   closed u32, link_up u32
    slot i (64 B at 64 * (i + 1)): state u32, rkey u32, addr u64, length u64

Locks are open-file-description locks (``F_OFD_SETLKW``) on a slot's 64 bytes,
so regions do not contend with each other and every open of the table (one per
concurrent write) owns its locks. An rkey is 32 random bits whose low bits are
the index of a slot picked at random: lookup is O(1) and the key unguessable.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

MAGIC = b"SIMNIC01"
VERSION = 1
SLOT_SIZE = 64
_HEADER = struct.Struct("<8sII16sII")
_SLOT = struct.Struct("<IIQQ")
_CLOSED_OFF = 32
_LINK_OFF = 36
FREE, LIVE, REVOKING = 0, 1, 2
_FLOCK = "hhqqi4x"  # struct flock on LP64 Linux: type, whence, start, len, pid


def _lock(fd: int, kind: int, slot: int) -> None:
    """Take (blocking) or drop an OFD lock on one slot's bytes."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack(_FLOCK, kind, os.SEEK_SET,
                                                    SLOT_SIZE * (slot + 1), SLOT_SIZE, 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotView:
    """One slot as a writer read it, under its shared lock."""

    state: int
    rkey: int
    addr: int
    length: int


class RegionTable:
    """The owner's side: creates the memfd and adds or revokes regions."""

    def __init__(self, name: str, nslots: int) -> None:
        if nslots <= 0 or nslots & (nslots - 1):
            raise ValueError(f"max_regions must be a power of two, not {nslots}")
        self.nslots = nslots
        self.nonce = secrets.token_bytes(16)
        self.fd = os.memfd_create(f"simnic-{name}", os.MFD_CLOEXEC)
        size = SLOT_SIZE * (nslots + 1)
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size)
        self._map[: _HEADER.size] = _HEADER.pack(MAGIC, VERSION, nslots, self.nonce, 0, 1)
        self._free = list(range(nslots))
        self._issued: set[int] = set()  # never reissue an rkey: a stale desc must not revive
        self._mutex = threading.Lock()

    def add(self, addr: int, length: int) -> tuple[int, int]:
        """Publish a live region; returns ``(slot, rkey)``."""
        with self._mutex:
            if not self._free:
                raise OverflowError(f"all {self.nslots} region slots are in use")
            i = secrets.randbelow(len(self._free))
            self._free[i], self._free[-1] = self._free[-1], self._free[i]
            slot = self._free.pop()
            rkey = 0
            while rkey == 0 or rkey in self._issued:
                rkey = (secrets.randbits(32) & ~(self.nslots - 1)) | slot
            self._issued.add(rkey)
        off = SLOT_SIZE * (slot + 1)
        _lock(self.fd, fcntl.F_WRLCK, slot)
        try:
            self._map[off : off + _SLOT.size] = _SLOT.pack(LIVE, rkey, addr, length)
        finally:
            _lock(self.fd, fcntl.F_UNLCK, slot)
        return slot, rkey

    def revoke(self, slot: int) -> None:
        """Free ``slot``; returns only after every chunk in flight into it has landed."""
        off = SLOT_SIZE * (slot + 1)
        self._map[off : off + 4] = struct.pack("<I", REVOKING)
        _lock(self.fd, fcntl.F_WRLCK, slot)
        try:
            self._map[off : off + _SLOT.size] = _SLOT.pack(FREE, 0, 0, 0)
        finally:
            _lock(self.fd, fcntl.F_UNLCK, slot)
        with self._mutex:
            self._free.append(slot)

    def set_link(self, up: bool) -> None:
        self._map[_LINK_OFF : _LINK_OFF + 4] = struct.pack("<I", int(up))

    def close(self) -> None:
        """Mark the table closed (writers then fail) and release it here."""
        if self._map.closed:
            return
        self._map[_CLOSED_OFF : _CLOSED_OFF + 4] = struct.pack("<I", 1)
        self._map.close()
        os.close(self.fd)


class RemoteTable:
    """A writer's view of a peer's table, opened without the peer running code."""

    def __init__(self, pid: int, fd: int, nonce: bytes) -> None:
        first = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(first).st_size
            self._map = mmap.mmap(first, size, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            os.close(first)
            raise
        magic, version, nslots, got_nonce, _, _ = _HEADER.unpack_from(self._map)
        if (magic, version, got_nonce) != (MAGIC, VERSION, nonce):
            self._map.close()
            os.close(first)
            raise OSError(f"/proc/{pid}/fd/{fd} is not the region table it was announced as")
        self.nslots = nslots
        self._fds = [first]  # idle lock handles; each concurrent write takes its own
        self._all = [first]
        self._mutex = threading.Lock()

    @contextlib.contextmanager
    def handle(self) -> Iterator[int]:
        """A table fd of one's own: OFD locks are owned per open, not per thread."""
        with self._mutex:
            if self._fds:
                fd = self._fds.pop()
            else:
                # Reopen through our own fd: works even after the owner has died.
                fd = os.open(f"/proc/self/fd/{self._all[0]}", os.O_RDONLY | os.O_CLOEXEC)
                self._all.append(fd)
        try:
            yield fd
        finally:
            with self._mutex:
                self._fds.append(fd)

    def slot_of(self, rkey: int) -> int:
        return rkey & (self.nslots - 1)

    @contextlib.contextmanager
    def locked(self, fd: int, slot: int) -> Iterator[SlotView]:
        """Hold the shared lock on ``slot`` and yield what it says."""
        _lock(fd, fcntl.F_RDLCK, slot)
        try:
            state, rkey, addr, length = _SLOT.unpack_from(self._map, SLOT_SIZE * (slot + 1))
            yield SlotView(state=state, rkey=rkey, addr=addr, length=length)
        finally:
            _lock(fd, fcntl.F_UNLCK, slot)

    @property
    def closed(self) -> bool:
        return struct.unpack_from("<I", self._map, _CLOSED_OFF)[0] != 0

    @property
    def link_up(self) -> bool:
        return struct.unpack_from("<I", self._map, _LINK_OFF)[0] != 0

    def close(self) -> None:
        with self._mutex:
            if not self._map.closed:
                self._map.close()
            for fd in self._all:
                os.close(fd)
            self._all, self._fds = [], []
