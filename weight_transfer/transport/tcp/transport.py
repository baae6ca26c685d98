"""``tcp``: our own TCP transport, for links without RDMA; every write is authenticated.

Usage (the controller does this through the handshake of :mod:`.handshake`)::

    target = make_transport("tcp", owner="engine0/tp0", nic="nic0", host="10.0.0.2")
    desc = target.register(buf)                         # starts the listener on host only
    target.grant("trainer3", "nic0", [desc.addr])       # what the plan gives this writer
    writer.connect(target.peer_info("trainer3", "nic0"))  # a fresh link key, over Ray
    target.open_window()                                # the engine paused for an update
    await writer.write(src, desc, dst_offset)
    target.close_window()                               # the engine resumes

What it protects (see docs/transports.md):

- Who connects: the target makes a fresh random link key for each (writer NIC,
  target NIC) pair the plan uses, at every setup (``peer_info``); it travels in
  the peer info over Ray (which authenticates) to that writer only. A writer
  proves the key in a challenge-response with nonces from both sides (HMAC-SHA256)
  and the target proves it back. Handshakes run on one selector thread (:mod:`.gate`);
  a connection that does not finish within ``handshake_timeout_s`` is dropped, and at
  most ``max_pending`` wait at once (a new one pushes out the oldest), so neither idle
  nor churning connections keep a writer out; the writer's connect is tried again with
  jittered exponential backoff until ``connect_timeout_s``.
- What each frame may do: per-connection keys (HKDF); every frame carries a
  sequence number and an AES-GCM tag, and the payload is encrypted too where
  :mod:`.encryption` says: by default (``encrypt`` unset) across hosts, not
  within one host (there authenticated in clear, GMAC); ``encrypt: true``:
  always; ``encrypt: false``: never, logged once per host pair it exposes.
  Tampered, replayed or reordered frames end the session. A write lands only in
  a region registered now (address and rkey), that the plan gave this writer
  (``grant``), within its bounds, and (``update_window: true``) between the
  engine's pause for an update and its resume. There is no read.
- Nothing is written before the whole frame is verified: the target receives
  into a reusable buffer, verifies, then copies (one extra copy of every byte).
- Refused connections and writes are counted (``refused_connections``,
  ``refused_writes``, ``refusals()``) and logged at most once per source per minute.

Transient faults: a connection lost with a frame in flight (:class:`TcpLinkError`);
the next try opens a new connection with the same key. An ack that does not come
within ``timeout_s`` is not transient. The listener binds only ``host``, never a
wildcard address.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import secrets
import threading
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field

from weight_transfer.sync.listen import is_loopback
from weight_transfer.transport.base import (
    PeerUnreachableError,
    RemoteAccessError,
    TransientTransportError,
    TransportBase,
    TransportOptions,
    source_buffer,
    target_buffer,
)
from weight_transfer.transport.tcp.client import (
    Channel,
    ChannelLost,
    HandshakeRefused,
    LinkParams,
    with_backoff,
)
from weight_transfer.transport.tcp.codec import load_codec
from weight_transfer.transport.tcp.encryption import warn_if_clear
from weight_transfer.transport.tcp.server import Listener, check_bind_host, max_payload_for
from weight_transfer.transport.tcp.target import Grant, Refusal, TargetTable
from weight_transfer.transport.tcp.wire import OK, STATUS_TEXT, KeyText, identity, new_link_key
from weight_transfer.types import PeerInfo, RegionDesc

log = logging.getLogger(__name__)


class TcpOptions(TransportOptions):
    """Options of the ``tcp`` transport (docs/configuration.md#transport-options)."""

    host: str | None = None  # the advertised and only bound address; None: the actor's
    port: int = Field(default=0, ge=0, le=65535)  # 0: a free port
    # None: encrypted across hosts, authenticated-only within one (.encryption); True or
    # False: always or never (never: logged once per host pair across hosts)
    encrypt: bool | None = None
    compression: Literal["none", "lz4", "zstd"] = "none"
    compression_level: int = Field(default=1, ge=1, le=19)  # zstd only
    chunk_bytes: int = Field(default=4 << 20, ge=4096, le=1 << 30)
    max_inflight: int = Field(default=4, ge=1)
    update_window: bool = True
    handshake_timeout_s: float = Field(default=2.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    timeout_s: float = Field(default=60.0, gt=0)
    max_pending: int = Field(default=64, ge=1)


class TcpLinkError(PeerUnreachableError, TransientTransportError):
    """The connection to the target was lost with a frame in flight: transient, retried
    under the policy (the next try connects again with the same key)."""


class _Link:
    """The writer's link to one target NIC: how to reach it and the live channel."""

    def __init__(self, params: LinkParams, channel: Channel) -> None:
        self.params, self.channel = params, channel
        self.lock = threading.Lock()

    def live(self) -> Channel:
        """The channel, reopened if its connection was lost (blocking)."""
        with self.lock:
            if self.channel.lost is not None:
                self.channel = with_backoff(lambda left: Channel(self.params, timeout_s=left),
                                            timeout_s=self.params.connect_timeout_s)
            return self.channel

    def close(self) -> None:
        self.channel.close()


class TcpTransport(TransportBase):
    """One NIC of the ``tcp`` transport; see the module docstring."""

    kind = "tcp"
    Options = TcpOptions

    @classmethod
    def open_kwargs(cls, options: TransportOptions, *, node: str = "",
                    address: str = "") -> dict[str, Any]:
        out = options.model_dump()
        if out["host"] is None:
            out["host"] = address or "127.0.0.1"
        return out

    @classmethod
    def reaches(cls, options: TransportOptions, src: Any, dst: Any) -> bool:
        """Other hosts, unless every actor advertises one fixed or loopback address."""
        return getattr(options, "host", None) is None and not is_loopback(dst.address)

    @classmethod
    def unreachable_reason(cls, options: TransportOptions) -> str:
        host = getattr(options, "host", None)
        if host is not None:
            return (f"tcp option host={host!r} is advertised by every actor; leave it null "
                    "to take each actor's own address")
        return "tcp would advertise a loopback address that other hosts cannot reach"

    def __init__(self, *, owner: str, nic: str = "tcp0", host: str = "127.0.0.1",
                 port: int = 0, encrypt: bool | None = None, compression: str = "none",
                 compression_level: int = 1, chunk_bytes: int = 4 << 20,
                 max_inflight: int = 4, update_window: bool = True,
                 handshake_timeout_s: float = 2.0, connect_timeout_s: float = 10.0,
                 timeout_s: float = 60.0, max_pending: int = 64) -> None:
        if not (owner and nic):
            raise ValueError(f"tcp: owner and nic must be non-empty ({owner=}, {nic=})")
        super().__init__(owner=owner, nic=nic)
        self.label = f"tcp {owner}/{nic}"
        self.host, self.port = check_bind_host(host), port
        self.encrypt, self.compression = encrypt, compression
        self.compression_level = compression_level
        load_codec(compression)  # ValueError naming the package, now rather than at a write
        self.chunk_bytes, self.max_inflight, self.timeout_s = chunk_bytes, max_inflight, timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._listen = dict(handshake_timeout_s=handshake_timeout_s, max_pending=max_pending)
        self._table = TargetTable(self.label, window=update_window)
        self._listener: Listener | None = None
        self._grants: dict[tuple[str, str], frozenset[int] | None] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_written = self.writes = 0

    # ------------------------------------------------------------------ target side

    def _ensure_listener(self) -> Listener:
        with self._lock:
            if self._listener is None:
                self._listener = Listener(
                    self._table, host=self.host, port=self.port,
                    target_id=identity(self.owner, self.nic), encrypt=self.encrypt,
                    codec=self.compression, max_payload=max_payload_for(self.chunk_bytes),
                    **self._listen)
                log.info("%s: listening on %s:%d", self.label, self.host, self._listener.port)
            return self._listener

    def register(self, buf: Any) -> RegionDesc:
        """Expose ``buf`` to the writers granted it (the listener starts on first use)."""
        self._check_open()
        tb = target_buffer(buf)
        with self._lock:
            for r in self._table.regions.values():
                d = r.desc
                if tb.addr < d.addr + d.length and d.addr < tb.addr + tb.nbytes:
                    raise ValueError(f"{self.label}: memory [{tb.addr:#x}, +{tb.nbytes}) "
                                     f"overlaps {d.describe()}")
            desc = RegionDesc(owner=self.owner, nic=self.nic, addr=tb.addr, length=tb.nbytes,
                              rkey=secrets.randbits(63) | 1, transport=self.kind,
                              node=self.host)
            self._table.add_region(desc, tb.keepalive)
        self._ensure_listener()
        return desc

    def deregister(self, desc: RegionDesc) -> None:
        """Revoke a region: later writes into it are refused (after copies in progress)."""
        try:
            self._table.remove_region(desc)
        except KeyError:
            raise ValueError(f"{self.label}: {desc.describe()} is not registered here") from None

    def regions(self) -> list[RegionDesc]:
        return [r.desc for r in list(self._table.regions.values())]

    def grant(self, remote_owner: str, remote_nic: str,
              regions: Iterable[int] | None = None) -> None:
        """Let NIC ``remote_nic`` of ``remote_owner`` write into ``regions`` (addresses;
        None: every region of this NIC); takes effect with the next ``peer_info`` for it."""
        with self._lock:
            self._grants[(remote_owner, remote_nic)] = \
                None if regions is None else frozenset(int(a) for a in regions)

    def open_window(self) -> None:
        """The engine paused for an update: granted writes are accepted until the resume."""
        self._table.set_window(True)

    def close_window(self) -> None:
        """The engine resumes: writes are refused; returns once no copy runs."""
        self._table.set_window(False)

    @property
    def refused_connections(self) -> int:
        return self._table.refused_connections

    @property
    def refused_writes(self) -> int:
        return self._table.refused_writes

    def refusals(self) -> list[Refusal]:
        """The latest refused connections and writes (time, peer, reason)."""
        return list(self._table.refusals)

    # ------------------------------------------------------------------ peers

    def peer_info(self, remote_owner: str, remote_nic: str | None = None) -> PeerInfo:
        """For a writer granted regions here: address, port and a fresh link key (its
        sessions under an older key are closed). For any other peer: no endpoint."""
        self._check_open()
        with self._lock:
            granted = (remote_owner, remote_nic) in self._grants
            regions = self._grants.get((remote_owner, remote_nic))
        endpoint: dict[str, Any] = {}
        if granted and remote_nic is not None:
            listener = self._ensure_listener()
            writer, key = identity(remote_owner, remote_nic), new_link_key()
            if self._table.grant(writer, Grant(key=key, regions=regions)) is not None:
                listener.drop_writer(writer)
            endpoint = {"host": self.host, "port": listener.port, "key": KeyText(key.hex()),
                        "encrypt": self.encrypt, "compression": self.compression,
                        "chunk_bytes": self.chunk_bytes}
        return PeerInfo(owner=self.owner, nic=self.nic, transport=self.kind, endpoint=endpoint)

    def check_peer(self, peer: PeerInfo) -> None:
        super().check_peer(peer)
        ep = peer.endpoint
        if not ep:
            return
        where = f"{self.label}: peer info of {peer.owner}/{peer.nic}"
        for name, typ in (("host", str), ("port", int), ("key", str),
                          ("encrypt", (bool, type(None))), ("compression", str),
                          ("chunk_bytes", int)):
            if not isinstance(ep.get(name), typ):
                want = " or ".join(t.__name__ for t in typ) if isinstance(typ, tuple) \
                    else typ.__name__
                raise ValueError(f"{where}: endpoint field {name!r} must be {want}, "
                                 f"not {type(ep.get(name)).__name__}")
        if (ep["encrypt"], ep["compression"]) != (self.encrypt, self.compression):
            raise ValueError(f"{where}: target uses encrypt={ep['encrypt']}, compression="
                             f"{ep['compression']!r}; this NIC encrypt={self.encrypt}, "
                             f"compression={self.compression!r}")

    def connect(self, peer: PeerInfo) -> None:
        """Connect and authenticate to a target that made a key for this NIC; a peer info
        without an endpoint (a writer into this NIC) needs nothing."""
        self._check_open()
        self.check_peer(peer)
        ep = peer.endpoint
        if not ep:
            return
        params = LinkParams(
            host=ep["host"], port=ep["port"], key=bytes.fromhex(ep["key"]),
            writer_id=identity(self.owner, self.nic), target_id=identity(peer.owner, peer.nic),
            encrypt=self.encrypt, codec=self.compression,
            chunk_bytes=min(self.chunk_bytes, ep["chunk_bytes"]),
            connect_timeout_s=self.connect_timeout_s, level=self.compression_level)
        channel = self._open_channel(params, f"{peer.owner}/{peer.nic}")
        warn_if_clear(self.encrypt, *channel.hosts, label=self.label,
                      target=f"{peer.owner}/{peer.nic}")
        link = _Link(params, channel)
        old = self._add_peer(peer.owner, peer.nic, link)
        if old is not None:
            old.close()
        log.info("%s: connected to %s/%s at %s:%d (%s)", self.label, peer.owner, peer.nic,
                 params.host, params.port,
                 "encrypted" if channel.encrypt else "authenticated, in clear")

    def encrypts_to(self, remote_owner: str, remote_nic: str) -> bool:
        """Whether this writer's link to that target NIC encrypts its payloads (decided
        per connection, :mod:`.encryption`); ValueError if not connected to it."""
        link = self._peer(remote_owner, remote_nic)
        if link is None:
            raise ValueError(f"{self.label}: not connected to {remote_owner}/{remote_nic}")
        return link.channel.encrypt

    def _open_channel(self, params: LinkParams, peer: str) -> Channel:
        """Connect and authenticate, tried again with jittered exponential backoff until
        ``connect_timeout_s`` (:func:`~.client.with_backoff`)."""
        where = f"{self.label}: {peer} at {params.host}:{params.port}"
        try:
            return with_backoff(lambda left: Channel(params, timeout_s=left),
                                timeout_s=self.connect_timeout_s)
        except HandshakeRefused as exc:
            raise PeerUnreachableError(f"{where} refused the handshake: {exc}") from None
        except ConnectionError as exc:
            raise PeerUnreachableError(f"{where}: {exc} (connect_timeout_s)") from None

    def _release_peer(self, conn: Any) -> None:
        conn.close()

    # ------------------------------------------------------------------ writes

    async def write(self, src: Any, dst: RegionDesc, dst_offset: int = 0) -> None:
        """Write all of ``src`` into ``dst`` at ``dst_offset``, in sealed frames of at most
        ``chunk_bytes``; RemoteAccessError if the target refused (nothing of that frame
        written), TcpLinkError if the connection was lost."""
        self._check_open()
        sb = source_buffer(src)
        self._check_destination(dst, dst_offset, sb.nbytes)
        link = self._peer_for(dst)
        if sb.nbytes == 0:
            return
        view = memoryview((ctypes.c_char * sb.nbytes).from_address(sb.addr)).cast("B")
        step = link.params.chunk_bytes
        try:
            async with asyncio.TaskGroup() as group:
                for off in range(0, sb.nbytes, step):
                    group.create_task(self._write_chunk(
                        link, dst, dst_offset + off, view[off:off + step]))
        except BaseExceptionGroup as exc:
            raise exc.exceptions[0] from None
        with self._lock:
            self.bytes_written += sb.nbytes
            self.writes += 1

    async def _write_chunk(self, link: _Link, dst: RegionDesc, offset: int,
                           data: memoryview) -> None:
        what = f"{self.label}: write of {len(data)} B at offset {offset} into {dst.describe()}"
        async with self._semaphore():
            try:
                channel = await asyncio.to_thread(link.live)
                fut = await asyncio.to_thread(channel.send, addr=dst.addr, rkey=dst.rkey,
                                              offset=offset, data=data)
                status = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
            except (ChannelLost, HandshakeRefused, OSError) as exc:
                raise TcpLinkError(f"{what}: connection lost: {exc}") from None
            except TimeoutError:
                raise PeerUnreachableError(f"{what}: no ack within {self.timeout_s:g} s") \
                    from None
        if status != OK:
            raise RemoteAccessError(f"{what}: refused by the target: write "
                                    f"{STATUS_TEXT.get(status, f'status {status}')}")

    # ------------------------------------------------------------------ teardown

    def _check_open(self) -> None:
        if self._closed:
            raise PeerUnreachableError(f"{self.label} is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self._take_peers():
            link.close()
        if self._listener is not None:
            self._listener.close()
