"""Mooncake TransferEngine as a transport: one engine is one NIC of one process.

Usage (the optional ``mooncake`` extra must be installed)::

    nic = make_transport("mooncake", owner="engine0/tp1", nic="mc0",
                         protocol="tcp", hostname="127.0.0.1", device_name="")
    desc = nic.register(tensor)                # target: publish desc (plain data)
    writer.connect(nic.peer_info("trainer3"))  # writer, once at setup
    await writer.write(src, desc, dst_offset)  # the target runs no Python code

How it maps onto Mooncake (checked against mooncake-transfer-engine-non-cuda 0.3.13):

1. ``initialize(hostname, "P2PHANDSHAKE", protocol, device_name)``: no metadata
   server; each engine answers handshakes on its own RPC port and the session
   id ``"host:port"`` (``PeerInfo.endpoint["session_id"]``) names it.
2. ``register`` is ``register_memory``. ``connect`` probes the peer's handshake
   port (``send_probe``); Mooncake opens the session at the first write.
3. ``write`` cuts the source into chunks of ``chunk_bytes``, submits each with
   ``transfer_submit_write`` on one daemon thread (a submit that opens a session
   to a stalled peer blocks for about a minute, and Mooncake serializes submits
   behind it anyway) and polls ``transfer_check_status`` from the event loop
   (``transfer_sync_write`` would busy-wait a core). At most ``max_inflight``
   chunks are in flight per event loop.
4. A chunk not done after ``timeout_s + bytes / min_gbps`` fails with
   :class:`PeerUnreachableError`. Mooncake may still read its source later, so
   the batch and the source stay referenced until Mooncake reports an end
   (after ``close``: for the life of the process).

Protection. Mooncake has no remote keys: each region gets a random ``rkey`` for
its descriptor, but the TCP protocol cannot enforce it (a forged rkey with a
live address range writes). Enforced are: on the writer, the range against the
descriptor (out of bounds: :class:`RemoteAccessError`, nothing sent); on the
target's TCP server, that each chunk lies inside one buffer registered now
(deregistered regions, forged lengths). A refused chunk is reported as
:class:`RemoteAccessError` when a probe shows the peer alive, else as
:class:`PeerUnreachableError`; other chunks of the same write may have landed.

Across hosts. The TCP protocol authenticates nothing, so a setup whose trainers
and engines run on different hosts is refused (a ValueError at setup naming both
ends and the option) unless ``transport_options.allow_unauthenticated`` is true,
which logs a warning that names the risk; within one host it stays allowed.
See docs/security.md.

Protocols other than ``"tcp"`` (``"rdma"``) send only from registered memory:
register the source (staging) buffers with the writer's NIC too.

Transient faults (retried under the executor's policy): a chunk that failed
while the peer's handshake port did not answer a probe at once (connection
refused or reset: a peer restarting or a link that is down) raises
:class:`MooncakeLinkError`; Mooncake opens a new session on the next submit.
A chunk that timed out is not transient: its batch may still be reading the
source, and each try would wait the whole timeout again.

``disconnect(owner, nic)`` forgets the peer's session: no later write goes to it
(Mooncake 0.3.13 has no call that closes one session; its sockets close with
the engine).

Environment: ``MC_LOG_LEVEL`` defaults to WARNING here (set it to see Mooncake's
INFO lines). Mooncake's listeners bind all interfaces whatever ``hostname`` is.
Destroying an engine takes about 1 s, and the next engine of the process waits
for it: ``close`` returns at once; create NICs once and keep them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from weight_transfer.sync.listen import is_loopback
from weight_transfer.transport.base import (
    PeerUnreachableError,
    RemoteAccessError,
    SourceBuffer,
    TransientTransportError,
    TransportBase,
    TransportError,
    TransportOptions,
    check_write_range,
    source_buffer,
    target_buffer,
)
from weight_transfer.transport.mooncake.calls import (
    UNAUTHENTICATED_RISK,
    CallThread,
    _first_error,
    _new_rkey,
    chunk_deadline_s,
    load_engine_class,
    parse_session_id,
    split_chunks,
    tcp_across_hosts_allowed,
)
from weight_transfer.types import PeerInfo, RegionDesc

logger = logging.getLogger(__name__)

METADATA = "P2PHANDSHAKE"
_SUBMIT_FAILED = frozenset({0, -1, 2**64 - 1})  # batch ids Mooncake returns on failure
_DONE, _PENDING = 1, 0  # transfer_check_status: 1 done, 0 pending, -1 failed, -2 timed out
_POLL_MIN_S, _POLL_MAX_S = 50e-6, 1e-3
_GRAVEYARD: list[Any] = []  # engines closed with transfers in flight, kept alive


class MooncakeOptions(TransportOptions):
    """Mooncake TransferEngine: ``hostname`` None takes each actor's own host address;
    ``allow_unauthenticated``: let TCP links cross hosts (refused by default)."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    hostname: str | None = None
    device_name: str = ""
    max_inflight: int = Field(default=8, ge=1)
    chunk_bytes: int = Field(default=64 << 20, ge=1)
    timeout_s: float = Field(default=30.0, gt=0)
    connect_timeout_s: float = Field(default=20.0, gt=0)
    allow_unauthenticated: bool = False


class MooncakeLinkError(PeerUnreachableError, TransientTransportError):
    """A chunk failed and the peer's handshake port refused a probe (connection refused
    or reset): transient, retried under the policy (a new session opens on the next try)."""


@dataclass(slots=True)
class _Chunk:
    """One submitted piece of a write, for error messages."""

    session: str
    peer: str
    src_addr: int
    dst_addr: int
    nbytes: int
    what: str


class MooncakeTransport(TransportBase):
    """One Mooncake engine = one NIC of this process. See the module docstring."""

    kind = "mooncake"
    Options = MooncakeOptions

    @classmethod
    def open_kwargs(cls, options: TransportOptions, *, node: str = "",
                    address: str = "") -> dict[str, Any]:
        """``hostname`` None takes the actor's own ``address``; no ``node`` keyword."""
        out = options.model_dump()
        if out["hostname"] is None:
            out["hostname"] = address or "127.0.0.1"
        return out

    @classmethod
    def reaches(cls, options: TransportOptions, src: Any, dst: Any) -> bool:
        """Other hosts, unless a fixed hostname (every actor's, wherever it runs) or a
        loopback address is advertised; over TCP only with ``allow_unauthenticated``."""
        if getattr(options, "hostname", None) is not None or is_loopback(dst.address):
            return False
        return tcp_across_hosts_allowed(options, src, dst)

    @classmethod
    def unreachable_reason(cls, options: TransportOptions) -> str:
        hostname = getattr(options, "hostname", None)
        if hostname is not None:
            return (f"mooncake option hostname={hostname!r} is advertised by every actor; "
                    "leave it null to take each actor's own address")
        if getattr(options, "protocol", "tcp") == "tcp" and not getattr(
                options, "allow_unauthenticated", False):
            return (f"refused: {UNAUTHENTICATED_RISK}; set transport_options."
                    "allow_unauthenticated: true to accept that on a network nobody else "
                    "reaches")
        return "mooncake would advertise a loopback address that other hosts cannot reach"

    def __init__(
        self, *, owner: str, nic: str = "mc0", protocol: str = "tcp",
        hostname: str = "127.0.0.1", device_name: str = "", max_inflight: int = 8,
        chunk_bytes: int = 64 << 20, timeout_s: float = 30.0, min_gbps: float = 0.1,
        connect_timeout_s: float = 20.0, allow_unauthenticated: bool = False,
    ) -> None:
        if not (owner and nic and protocol and hostname):
            raise ValueError(f"owner, nic, protocol, hostname must be non-empty ({owner=}, {nic=})")
        if min(max_inflight, chunk_bytes, timeout_s, min_gbps, connect_timeout_s) <= 0:
            raise ValueError(
                f"mooncake {owner}/{nic}: max_inflight={max_inflight}, chunk_bytes={chunk_bytes},"
                f" timeout_s={timeout_s}, min_gbps={min_gbps}, connect_timeout_s="
                f"{connect_timeout_s}: all must be positive"
            )
        super().__init__(owner=owner, nic=nic)
        self.protocol, self.hostname = protocol, hostname
        if allow_unauthenticated and protocol == "tcp":
            logger.warning("mooncake %s/%s: allow_unauthenticated: %s", owner, nic,
                           UNAUTHENTICATED_RISK)
        self._me = self.label = f"mooncake {owner}/{nic}"  # how messages name this NIC
        self.max_inflight, self.chunk_bytes, self.timeout_s = max_inflight, chunk_bytes, timeout_s
        self.min_gbps, self.connect_timeout_s = min_gbps, connect_timeout_s
        engine = load_engine_class()()
        rc = engine.initialize(hostname, METADATA, protocol, device_name)
        if rc != 0:
            raise TransportError(
                f"mooncake {owner}/{nic}: initialize(hostname={hostname!r}, protocol={protocol!r},"
                f" device_name={device_name!r}) returned {rc}"
            )
        self._engine = engine
        self.session_id = f"{hostname}:{engine.get_rpc_port()}"
        self._calls = CallThread(f"mooncake-{owner}-{nic}")
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[RegionDesc, Any]] = {}  # addr -> (desc, keepalive)
        self._abandoned: list[tuple[int, Any]] = []  # (batch id, source it may still read)
        self._closed = False
        self.bytes_written = self.writes = 0  # writes this NIC completed, and their bytes
        logger.info("mooncake %s/%s: %s engine at %s", owner, nic, protocol, self.session_id)

    # ------------------------------------------------------------------ regions

    def register(self, buf: Any) -> RegionDesc:
        """Register ``buf`` with the engine; the rkey is ours only (see the module doc)."""
        self._check_open()
        tb = target_buffer(buf)
        with self._lock:
            for d, _ in self._regions.values():
                if tb.addr < d.addr + d.length and d.addr < tb.addr + tb.nbytes:
                    raise ValueError(
                        f"{self._me}: memory [{tb.addr:#x}, +{tb.nbytes}) overlaps "
                        f"{d.describe()}; Mooncake cannot register overlapping regions"
                    )
            rc = self._engine.register_memory(tb.addr, tb.nbytes)
            if rc != 0:
                raise TransportError(
                    f"{self._me}: register_memory(addr={tb.addr:#x}, length={tb.nbytes}) -> {rc}"
                )
            desc = RegionDesc(
                owner=self.owner, nic=self.nic, addr=tb.addr, length=tb.nbytes,
                rkey=_new_rkey({d.rkey for d, _ in self._regions.values()}),
                transport=self.kind, node=self.hostname,
            )
            self._regions[tb.addr] = (desc, tb.keepalive)
        logger.debug("mooncake %s/%s: registered %s", self.owner, self.nic, desc.describe())
        return desc

    def deregister(self, desc: RegionDesc) -> None:
        """Unregister a region; the target's server then refuses writes into it."""
        self._check_open()
        with self._lock:
            if self._regions.get(desc.addr, (None,))[0] != desc:
                raise ValueError(f"{self._me}: {desc.describe()} is not registered here")
            rc = self._engine.unregister_memory(desc.addr)
            if rc != 0:
                raise TransportError(f"{self._me}: unregister_memory({desc.describe()}) -> {rc}")
            del self._regions[desc.addr]

    def regions(self) -> list[RegionDesc]:
        """Descriptors of the regions registered now."""
        with self._lock:
            return [d for d, _ in self._regions.values()]

    # ------------------------------------------------------------------ peers

    def peer_info(self, remote_owner: str, remote_nic: str | None = None) -> PeerInfo:
        """What ``remote_owner`` passes to ``connect`` to write into this NIC's regions
        (the same for every remote NIC: Mooncake opens sessions on the first write)."""
        self._check_open()
        return PeerInfo(
            owner=self.owner, nic=self.nic, transport=self.kind,
            endpoint={"session_id": self.session_id, "protocol": self.protocol},
        )

    def connect(self, peer: PeerInfo) -> None:
        """Check that the peer answers on its handshake port, then record its session."""
        self._check_open()
        where = f"{self._me}: connect to {peer.owner}/{peer.nic}"
        if peer.transport != self.kind:
            raise ValueError(f"{where}: the peer info is for transport {peer.transport!r}")
        session = parse_session_id(peer.endpoint.get("session_id"), where)
        if peer.endpoint.get("protocol", self.protocol) != self.protocol:
            raise ValueError(
                f"{where}: peer speaks {peer.endpoint['protocol']!r}, this NIC {self.protocol!r}"
            )
        fut = self._calls.call(self._engine.send_probe, session)
        try:
            rc = fut.result(timeout=self.connect_timeout_s)
        except concurrent.futures.TimeoutError:
            raise PeerUnreachableError(
                f"{where}: no answer from {session} within {self.connect_timeout_s:.0f}s"
            ) from None
        if rc != 0:
            raise PeerUnreachableError(f"{where}: handshake probe of {session} failed (code {rc})")
        self._add_peer(peer.owner, peer.nic, session)  # the peer table holds session ids
        logger.info("%s: session %s", where, session)

    def _session_for(self, dst: RegionDesc) -> str:
        self._check_region(dst)
        if dst.addr <= 0 or dst.length <= 0:
            raise ValueError(f"{self._me}: bad descriptor {dst.describe()}")
        return self._peer_for(dst)

    # ------------------------------------------------------------------ writes

    async def write(self, src: Any, dst: RegionDesc, dst_offset: int = 0) -> None:
        """One-sided write of all of ``src`` into ``dst`` at ``dst_offset`` bytes."""
        self._check_open()
        session = self._session_for(dst)
        sb = source_buffer(src)
        check_write_range(dst, dst_offset, sb.nbytes)
        if sb.nbytes == 0:
            return
        self._reap()
        what = f"write of {sb.nbytes} B at offset {dst_offset} into {dst.describe()}"
        if self.protocol != "tcp" and not self._registered_here(sb):
            raise ValueError(
                f"{self._me}: {what}: protocol {self.protocol!r} sends only from registered "
                f"memory; register the source [{sb.addr:#x}, +{sb.nbytes}) first"
            )
        try:
            async with asyncio.TaskGroup() as group:
                for off, n in split_chunks(sb.nbytes, self.chunk_bytes):
                    chunk = _Chunk(session, f"{dst.owner}/{dst.nic}", sb.addr + off,
                                   dst.addr + dst_offset + off, n, what)
                    group.create_task(self._write_chunk(chunk, sb.keepalive))
        except BaseExceptionGroup as group_exc:
            raise _first_error(group_exc) from None
        with self._lock:
            self.bytes_written += sb.nbytes
            self.writes += 1

    async def _write_chunk(self, chunk: _Chunk, keepalive: Any) -> None:
        where = f"{self._me}: {chunk.what} to {chunk.peer} at {chunk.session}"
        async with self._semaphore():
            deadline = time.monotonic() + chunk_deadline_s(chunk.nbytes, self.timeout_s,
                                                           self.min_gbps)
            fut = self._calls.call(self._engine.transfer_submit_write, chunk.session,
                                   chunk.src_addr, chunk.dst_addr, chunk.nbytes)
            try:
                bid = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
            except BaseException as exc:
                fut.add_done_callback(lambda f: self._adopt(f, keepalive))
                if isinstance(exc, TimeoutError):
                    raise PeerUnreachableError(
                        f"{where}: submit blocked for {self.timeout_s:.0f}s (handshake stalled)"
                    ) from None
                raise
            if bid in _SUBMIT_FAILED:
                raise PeerUnreachableError(f"{where}: submit failed (the session did not open)")
            try:
                status = await self._poll(bid, deadline)
            except BaseException:
                self._abandon(bid, keepalive)
                raise
            if status is None:
                self._abandon(bid, keepalive)
                raise PeerUnreachableError(
                    f"{where}: a chunk of {chunk.nbytes} B did not complete within "
                    f"{chunk_deadline_s(chunk.nbytes, self.timeout_s, self.min_gbps):.1f}s"
                )
            if status != _DONE:
                raise await self._classify_failure(chunk, status, where)

    async def _poll(self, bid: int, deadline: float) -> int | None:
        """Final status of a batch (1 done, <0 failed), or None past the deadline."""
        delay = _POLL_MIN_S
        while (status := self._engine.transfer_check_status(bid)) == _PENDING:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return status

    async def _classify_failure(self, chunk: _Chunk, status: int, where: str) -> TransportError:
        """A failed chunk: refused by a live peer, or the peer is gone (no probe answer)."""
        fut = self._calls.call(self._engine.send_probe, chunk.session)
        try:
            probe = await asyncio.wait_for(asyncio.wrap_future(fut), self.connect_timeout_s)
        except TimeoutError:
            probe = None
        if probe == 0:
            return RemoteAccessError(
                f"{where}: refused (status {status}): bytes [{chunk.dst_addr:#x}, "
                f"+{chunk.nbytes}) are not inside a region the target has registered now"
            )
        if probe is None:  # no answer in time: a stalled peer, not retried
            return PeerUnreachableError(
                f"{where}: failed (status {status}) and the peer does not answer a probe")
        return MooncakeLinkError(f"{where}: failed (status {status}) and the peer does not "
                                 f"answer a probe ({probe}: connection refused or reset)")

    def _registered_here(self, sb: SourceBuffer) -> bool:
        with self._lock:
            return any(d.addr <= sb.addr and sb.addr + sb.nbytes <= d.addr + d.length
                       for d, _ in self._regions.values())

    # ------------------------------------------------------------------ abandoned batches

    def _abandon(self, bid: int, keepalive: Any) -> None:
        with self._lock:
            self._abandoned.append((bid, keepalive))

    def _adopt(self, fut: concurrent.futures.Future, keepalive: Any) -> None:
        """A submit that returned after its write gave up: track the batch it started."""
        if not fut.cancelled() and fut.exception() is None and fut.result() not in _SUBMIT_FAILED:
            self._abandon(fut.result(), keepalive)

    def _reap(self) -> None:
        """Forget abandoned batches Mooncake has ended (checking frees them)."""
        with self._lock:
            self._abandoned[:] = [
                (bid, keep) for bid, keep in self._abandoned
                if self._engine.transfer_check_status(bid) == _PENDING
            ]

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self._me} is closed")

    def close(self) -> None:
        """Unregister every region and release the engine; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._reap()
        with self._lock:
            for addr in self._regions:
                self._engine.unregister_memory(addr)
            self._regions.clear()
        box, self._engine = [self._engine], None  # from here on, the box holds the engine
        if self._abandoned or self._calls.busy:
            logger.warning(
                "mooncake %s/%s: closed with %d transfers in flight; keeping the engine and "
                "their sources alive", self.owner, self.nic, len(self._abandoned),
            )
            _GRAVEYARD.append((box.pop(), self._abandoned, self._calls))
        else:  # the engine's destructor waits ~1 s for a metadata thread: not on the caller
            self._calls.call(box.clear)
        self._calls.stop()
