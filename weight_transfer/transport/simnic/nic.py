"""simnic: a simulated RDMA NIC with RDMA semantics, for hosts without RDMA hardware.

One :class:`SimNic` is one NIC of one process; a process may hold several.

* ``register(buf)`` pre-faults the memory, picks a random 32-bit rkey and
  publishes (addr, length, rkey, live) in the NIC's region table, a small
  shared-memory file (see :mod:`._regtable`).
* ``peer_info()`` publishes the pid, its start time (pid reuse is detected) and
  the table's fd number; ``connect(peer)`` opens the peer's table through
  ``/proc/<pid>/fd/<n>`` and a pidfd on the peer process. The peer runs no code.
* ``await write(src, dst, offset)`` is a one-sided WRITE: in a worker thread, per
  chunk of ``chunk_bytes``, it takes the shared lock on the target slot, checks
  rkey, bounds and liveness, and copies with ``process_vm_writev`` straight into
  the target's memory. Refused writes raise :class:`RemoteAccessError` or
  :class:`PeerUnreachableError` naming the region and peer, and write nothing.
* ``deregister(desc)`` revokes the region: once it returns, no write lands.
* ``register_source(buf)`` records memory the NIC's writes read from (a staging
  arena, a trainer's zero-copy parameters); the NIC reads any host memory, so it
  refuses nothing, but ``source_table.source_bytes`` counts what it sent from them.
* ``disconnect(owner, nic)`` drops the connection to a peer NIC: its table and
  process handle close once no write through them is in flight; later writes to
  it raise :class:`PeerUnreachableError` saying it was disconnected.
* Transient faults: a link down (:class:`LinkDownError`), which the executor's
  retry policy rides out; every other error is permanent.
* Link model: ``bandwidth_gbps`` caps the NIC (1 GB/s = 1e9 B/s), ``latency_us``
  is added to every write, ``max_inflight`` bounds writes in flight (more
  await), ``set_link(False)``, ``flap_link(s)`` (down for ``s`` seconds from
  the next write on) and ``fail_after_bytes(n)`` inject faults.
* Uncapped writes of at most ``inline_bytes`` (default 1 MiB, under ~100 us)
  run on the event loop's thread: the hop to a worker thread costs 40 us and
  more on a busy machine. Larger or capped writes run in worker threads (ctypes
  releases the GIL), so the event loop stays free.

Usage (target and writer may be different processes on one host)::

    target = SimNic(owner="engine0", nic="nic0")
    desc = target.register(weights)                   # send desc + peer info over
    writer = SimNic(owner="trainer0", nic="nic1")
    writer.connect(target.peer_info("trainer0"))
    await writer.write(tensor, desc, dst_offset=4096)
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from weight_transfer.transport.base import (
    PeerUnreachableError,
    TransportBase,
    TransportError,
    TransportOptions,
    source_buffer,
    target_buffer,
)
from weight_transfer.transport.buffers import SourceTable
from weight_transfer.transport.simnic import vm as _vm
from weight_transfer.transport.simnic.datapath import DataPath, Peer
from weight_transfer.transport.simnic.link import LinkModel
from weight_transfer.transport.simnic.regtable import RegionTable, RemoteTable
from weight_transfer.types import PeerInfo, RegionDesc

logger = logging.getLogger(__name__)

_ENDPOINT_KEYS = ("pid", "start_time", "table_fd", "table_nonce", "boot_id", "pid_ns")


class SimNicOptions(TransportOptions):
    """Simulated NIC (one host): a bandwidth cap and added latency model a real fabric."""

    bandwidth_gbps: float | None = Field(default=None, gt=0)  # GB/s per NIC; None: memcpy speed
    latency_us: float = Field(default=0.0, ge=0)
    max_inflight: int = Field(default=4, ge=1)
    chunk_bytes: int = Field(default=8 << 20, ge=4096)


@dataclass(slots=True)
class _Registered:
    slot: int
    desc: RegionDesc
    keepalive: Any


def _positive_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"SimNic: {name} must be an integer >= {minimum}, not {value!r}")
    return value


def _check_args(owner: Any, nic: Any, bandwidth_gbps: Any, latency_us: Any) -> None:
    for name, value in (("owner", owner), ("nic", nic)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"SimNic: {name} must be a non-empty string, not {value!r}")
    if bandwidth_gbps is not None and (
        isinstance(bandwidth_gbps, bool)
        or not isinstance(bandwidth_gbps, int | float)
        or not math.isfinite(bandwidth_gbps)
        or bandwidth_gbps <= 0
    ):
        raise ValueError(f"SimNic: bandwidth_gbps must be None or > 0, not {bandwidth_gbps!r}")
    if (
        isinstance(latency_us, bool)
        or not isinstance(latency_us, int | float)
        or not math.isfinite(latency_us)
        or latency_us < 0
    ):
        raise ValueError(f"SimNic: latency_us must be a number >= 0, not {latency_us!r}")


# Each endpoint field's type and, for numbers, its range (a pid, an fd, clock ticks ...).
_ENDPOINT_TYPES: dict[str, tuple[type, int]] = {
    "pid": (int, 1 << 22), "start_time": (int, 1 << 63), "table_fd": (int, 1 << 31),
    "table_nonce": (str, 0), "boot_id": (str, 0), "pid_ns": (int, 1 << 64)}


def _check_endpoint(ep: dict, where: str) -> None:
    """Types and ranges of a simnic endpoint, before any of it is used."""
    for key, (kind, hi) in _ENDPOINT_TYPES.items():
        value = ep[key]
        lo = 1 if key == "pid" else 0
        if type(value) is not kind or (kind is int and not lo <= value < hi):
            want = f"an int in [{lo}, {hi})" if kind is int else "a string"
            raise ValueError(f"{where}: endpoint {key} must be {want}, not {value!r:.40}")
    try:
        bytes.fromhex(ep["table_nonce"])
    except ValueError:
        raise ValueError(f"{where}: endpoint table_nonce is not hex: "
                         f"{ep['table_nonce']!r:.40}") from None


class SimNic(TransportBase):
    """A simulated RDMA NIC (implements :class:`~weight_transfer.transport.base.Transport`)."""

    kind = "simnic"
    Options = SimNicOptions

    @classmethod
    def reaches(cls, options: TransportOptions, src: Any, dst: Any) -> bool:
        """Only its own host: ``process_vm_writev`` reaches processes of this host."""
        return False

    @classmethod
    def unreachable_reason(cls, options: TransportOptions) -> str:
        return "simnic writes with process_vm_writev into processes of its own host"

    def __init__(
        self,
        *,
        owner: str,
        nic: str = "nic0",
        bandwidth_gbps: float | None = None,
        latency_us: float = 0.0,
        max_inflight: int = 4,
        chunk_bytes: int = 8 << 20,
        max_regions: int = 16384,
        inline_bytes: int = 1 << 20,
        node: str = "",
    ) -> None:
        _check_args(owner, nic, bandwidth_gbps, latency_us)
        super().__init__(owner=owner, nic=nic)
        self.node = node
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_us = float(latency_us)
        self.max_inflight = _positive_int("max_inflight", max_inflight, 1)
        self.chunk_bytes = _positive_int("chunk_bytes", chunk_bytes, _vm.PAGE_SIZE)
        self.inline_bytes = _positive_int("inline_bytes", inline_bytes, 0)
        _positive_int("max_regions", max_regions, 1)
        if max_regions > 1 << 20:
            raise ValueError(f"SimNic: max_regions must be at most 2**20, not {max_regions}")
        self._table = RegionTable(f"{owner}-{nic}", max_regions)
        self.source_table = SourceTable(self.label)  # register_source: what writes read from
        self._link = LinkModel(bandwidth_gbps)
        self._regions: dict[int, _Registered] = {}
        self._retired: list[Peer] = []  # replaced or disconnected, closed once unused
        self._users: dict[int, int] = {}  # id(peer) -> writes in flight through it
        self._mutex = threading.Lock()
        self._executor = ThreadPoolExecutor(max_inflight, thread_name_prefix=f"simnic-{nic}")
        self._wake = os.eventfd(0, os.EFD_CLOEXEC)  # readable once the NIC closes
        self._closed = False
        self._flap: float | None = None  # flap_link: seconds down, armed for the next write
        self._path = DataPath(
            label=self.label, link=self._link, chunk_bytes=self.chunk_bytes,
            wake_fd=self._wake, is_closed=lambda: self._closed,
        )

    # ------------------------------------------------------------------ counters

    @property
    def bytes_written(self) -> int:
        """Bytes this NIC delivered into remote memory."""
        return self._link.bytes_written

    @property
    def writes(self) -> int:
        """Writes this NIC completed successfully."""
        return self._link.writes

    @property
    def inflight(self) -> int:
        return self._link.inflight

    @property
    def peak_inflight(self) -> int:
        """Most writes ever admitted at once (never above ``max_inflight``)."""
        return self._link.peak_inflight

    def register_source(self, buf: Any) -> int:
        """Record ``buf`` as memory writes read from (any host memory is readable here;
        ``source_table.source_bytes`` counts the bytes sent from registered ones)."""
        return self.source_table.add(buf)

    def deregister_source(self, handle: int) -> None:
        self.source_table.remove(handle)

    # ------------------------------------------------------------------ target side

    def register(self, buf: Any) -> RegionDesc:
        """Pre-fault ``buf`` and expose it to writers; returns its descriptor."""
        self._check_open()
        mem = target_buffer(buf)
        _vm.prefault(mem.addr, mem.nbytes)
        try:
            slot, rkey = self._table.add(mem.addr, mem.nbytes)
        except OverflowError as e:
            raise TransportError(f"{self.label}: cannot register {mem.nbytes} B: {e}") from None
        desc = RegionDesc(
            owner=self.owner, nic=self.nic, addr=mem.addr, length=mem.nbytes, rkey=rkey,
            transport=self.kind, node=self.node,
        )
        with self._mutex:
            self._regions[rkey] = _Registered(slot=slot, desc=desc, keepalive=mem.keepalive)
        logger.debug("%s registered %s", self.label, desc.describe())
        return desc

    def deregister(self, desc: RegionDesc) -> None:
        """Revoke ``desc``: waits for chunks in flight into it; no later write lands."""
        self._check_open()
        with self._mutex:
            reg = self._regions.get(desc.rkey)
            if reg is None or reg.desc != desc:
                raise ValueError(f"{desc.describe()} is not registered on {self.label}")
            del self._regions[desc.rkey]
        self._table.revoke(reg.slot)
        logger.debug("%s deregistered %s", self.label, desc.describe())

    def set_link(self, up: bool) -> None:
        """Bring this NIC's link up or down; down, writes from and into it fail."""
        self._link.up = bool(up)
        if not self._closed:
            self._table.set_link(bool(up))

    def flap_link(self, down_s: float) -> None:
        """At the start of the next write, bring the link down for ``down_s`` seconds
        (a transient fault that surely hits a write: retries then ride it out)."""
        if isinstance(down_s, bool) or not isinstance(down_s, int | float) or \
                not 0 < down_s <= 60:
            raise ValueError(f"SimNic: flap_link down_s must be in (0, 60], not {down_s!r}")
        self._flap = float(down_s)

    def _start_flap(self) -> None:
        with self._mutex:
            down_s, self._flap = self._flap, None
        if down_s is not None:
            self.set_link(False)
            timer = threading.Timer(down_s, lambda: self._closed or self.set_link(True))
            timer.daemon = True
            timer.start()

    def set_bandwidth(self, bandwidth_gbps: float | None) -> None:
        """Re-cap this NIC at ``bandwidth_gbps`` GB/s (None: uncapped), between writes."""
        _check_args(self.owner, self.nic, bandwidth_gbps, self.latency_us)
        self.bandwidth_gbps = bandwidth_gbps
        self._link.set_bandwidth(bandwidth_gbps)

    def fail_after_bytes(self, nbytes: int | None) -> None:
        """Deliver ``nbytes`` more bytes, then fail the write that needs more (None: off)."""
        if nbytes is not None:
            _positive_int("fail_after_bytes", nbytes, 0)
        self._link.set_budget(nbytes)

    def peer_info(self, remote_owner: str = "", remote_nic: str | None = None) -> PeerInfo:
        """How to reach this NIC (the same for every remote owner and NIC)."""
        self._check_open()
        boot_id, pid_ns = _vm.host_identity()
        pid = os.getpid()
        endpoint = {
            "pid": pid,
            "start_time": _vm.proc_start_time(pid),
            "table_fd": self._table.fd,
            "table_nonce": self._table.nonce.hex(),
            "boot_id": boot_id,
            "pid_ns": pid_ns,
        }
        return PeerInfo(owner=self.owner, nic=self.nic, transport=self.kind, endpoint=endpoint)

    # ------------------------------------------------------------------ writer side

    def check_peer(self, peer: PeerInfo) -> None:
        """ValueError naming the field if ``peer`` is not a well-formed simnic endpoint."""
        super().check_peer(peer)
        missing = [k for k in _ENDPOINT_KEYS if k not in peer.endpoint]
        if missing:
            raise ValueError(f"peer info of {peer.owner}/{peer.nic} lacks {missing}")
        _check_endpoint(peer.endpoint, f"peer info of {peer.owner}/{peer.nic}")

    def connect(self, peer: PeerInfo) -> None:
        """Open ``peer``'s region table and process handle (idempotent per endpoint)."""
        self._check_open()
        self.check_peer(peer)
        ep = peer.endpoint
        label = f"peer {peer.owner}/{peer.nic} (pid {ep['pid']})"
        if (ep["boot_id"], ep["pid_ns"]) != _vm.host_identity():
            raise PeerUnreachableError(
                f"{label} is on another host or pid namespace; simnic reaches only this one"
            )
        known = self._peer(peer.owner, peer.nic)
        if known is not None and known.endpoint == ep:
            return
        try:
            proc = _vm.ProcessHandle.open(ep["pid"], start_time=ep["start_time"])
        except OSError as e:  # gone (ProcessLookupError), or not a process we may open
            raise PeerUnreachableError(f"cannot connect to {label}: {e}") from None
        try:
            table = RemoteTable(ep["pid"], ep["table_fd"], bytes.fromhex(ep["table_nonce"]))
        except OSError as e:
            proc.close()
            raise PeerUnreachableError(f"cannot open the region table of {label}: {e}") from None
        old = self._add_peer(peer.owner, peer.nic,
                             Peer(label=label, endpoint=dict(ep), proc=proc, table=table))
        if old is not None:
            self._release_peer(old)  # a write in flight may still use it
        logger.info("%s connected to %s", self.label, label)

    async def write(self, src: Any, dst: RegionDesc, dst_offset: int = 0) -> None:
        """One-sided WRITE of all of ``src`` into ``dst`` at ``dst_offset`` bytes."""
        self._check_open()
        mem = source_buffer(src)
        self._check_destination(dst, dst_offset, mem.nbytes)
        peer = self._use_peer(dst)
        try:
            await self._write_through(peer, mem, dst, dst_offset)
        finally:
            self._unuse_peer(peer)
        self.source_table.sent(mem)

    async def _write_through(self, peer: Peer, mem: Any, dst: RegionDesc,
                             dst_offset: int) -> None:
        if self._flap is not None:
            self._start_flap()
        async with self._semaphore():
            self._link.enter()
            ok = False
            try:
                if self.latency_us:
                    await asyncio.sleep(self.latency_us / 1e6)
                self._check_open()
                abort = threading.Event()
                if mem.nbytes <= self.inline_bytes and self.bandwidth_gbps is None:
                    # Small and uncapped: cheaper here than a hop to a worker thread.
                    self._path.transfer(peer, dst, dst_offset, mem, abort)
                else:
                    job = self._executor.submit(
                        self._path.transfer, peer, dst, dst_offset, mem, abort
                    )
                    try:
                        await asyncio.wrap_future(job)
                    except asyncio.CancelledError:
                        abort.set()  # the worker stops before its next chunk
                        raise
                ok = True
            finally:
                self._link.leave(ok)

    def close(self) -> None:
        """Abort writes in flight, deregister everything, drop connections (idempotent)."""
        if self._closed:
            return
        self._closed = True
        os.eventfd_write(self._wake, 1)
        self._executor.shutdown(wait=True)
        with self._mutex:
            regions, self._regions = list(self._regions.values()), {}
        peers = self._take_peers()
        with self._mutex:
            peers += self._retired
            self._retired = []
        for reg in regions:
            self._table.revoke(reg.slot)
        self._table.close()
        for peer in peers:
            peer.close()
        os.close(self._wake)
        logger.debug("%s closed", self.label)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.label} is closed")

    def _use_peer(self, dst: RegionDesc) -> Peer:
        """The peer of ``dst``, counted as in use until :meth:`_unuse_peer`."""
        peer = self._peer_for(dst)
        with self._mutex:
            self._users[id(peer)] = self._users.get(id(peer), 0) + 1
        return peer

    def _unuse_peer(self, peer: Peer) -> None:
        with self._mutex:
            left = self._users[id(peer)] = self._users[id(peer)] - 1
            if left == 0:
                del self._users[id(peer)]
            done = left == 0 and any(p is peer for p in self._retired)
            if done:
                self._retired = [p for p in self._retired if p is not peer]
        if done:
            peer.close()

    def _release_peer(self, conn: Peer) -> None:
        """A replaced or disconnected peer: closed now, or by the last write using it."""
        with self._mutex:
            busy = id(conn) in self._users
            if busy:
                self._retired.append(conn)
        if not busy:
            conn.close()
