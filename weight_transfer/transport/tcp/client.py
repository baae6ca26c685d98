"""The writer's side of one ``tcp`` link: a connection that proves its key, then frames.

:class:`Channel` connects and runs the handshake of :mod:`._tcp_wire` (it checks
the server's proof too: a process that does not hold the link key cannot pose
as the target), in the mode :mod:`.encryption` decides for the connection's two
addresses, then sends frames with ``sendmsg`` (scatter-gather: the
sealed header and the source bytes themselves, no copy in the plain mode)
under one lock (sequence numbers go out in order) and reads the sealed acks on
a thread of its own, which resolves one future per frame. A lost connection
fails every frame in flight with :class:`ChannelLost`; the transport opens a
new channel for the next write.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import threading
from dataclasses import dataclass

from weight_transfer.transport.tcp.codec import Codec
from weight_transfer.transport.tcp.encryption import link_encrypts
from weight_transfer.transport.tcp.server import recv_exact
from weight_transfer.transport.tcp.wire import (
    ACCEPT,
    MODE_ENCRYPT,
    MODE_PLAIN,
    NONCE_BYTES,
    OP_WRITE,
    PROOF_BYTES,
    SEALED_ACK_BYTES,
    Header,
    Opener,
    Sealer,
    WireError,
    check_proof,
    pack_hello,
    proof,
    session_keys,
    transcript,
)


class ChannelLost(ConnectionError):
    """The connection ended (or never authenticated) with frames in flight."""


class HandshakeRefused(ConnectionError):
    """The target did not prove the link key (another key: a newer setup, or not ours)."""


class HandshakeClosed(HandshakeRefused):
    """The target closed the handshake: pushed out by newer connections, or timed out
    (worth another try)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkParams:
    """How a writer reaches one target NIC (from the target's peer info)."""

    host: str
    port: int
    key: bytes
    writer_id: bytes
    target_id: bytes
    encrypt: bool | None  # None: across hosts only (.encryption)
    codec: str
    chunk_bytes: int
    connect_timeout_s: float
    level: int = 1  # zstd compression level


def sendmsg_all(sock: socket.socket, parts: list) -> None:
    """Send every buffer of ``parts`` in order (``sendmsg`` may send part of them)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


class Channel:
    """One authenticated connection to a target NIC; see the module docstring."""

    def __init__(self, params: LinkParams) -> None:
        self.params = params
        self.codec = Codec(params.codec, params.level)
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._seq = 0
        self.lost: BaseException | None = None
        self._sock = socket.create_connection((params.host, params.port),
                                              timeout=params.connect_timeout_s)
        try:
            local, peer = self._sock.getsockname()[0], self._sock.getpeername()[0]
            self.encrypt = link_encrypts(params.encrypt, local, peer)
            self.hosts = (local, peer)  # this end's address, the target's
            self._sealer, self._opener = self._handshake()
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = threading.Thread(target=self._read_acks, daemon=True,
                                        name=f"wt-tcp-acks-{params.host}:{params.port}")
        self._reader.start()

    def _handshake(self) -> tuple[Sealer, Opener]:
        p = self.params
        mode = MODE_ENCRYPT if self.encrypt else MODE_PLAIN
        nonce_c = os.urandom(NONCE_BYTES)
        self._sock.sendall(pack_hello(mode, self.codec.id, nonce_c, p.writer_id))
        try:
            nonce_s = recv_exact(self._sock, NONCE_BYTES)
            server_proof = recv_exact(self._sock, PROOF_BYTES)
            data = transcript(mode, self.codec.id, nonce_c, nonce_s, p.writer_id, p.target_id)
            if not check_proof(p.key, b"server", data, server_proof):
                raise HandshakeRefused("the target did not prove the link key (another "
                                       "key, or another mode or codec)")
            self._sock.sendall(proof(p.key, b"client", data))
            if recv_exact(self._sock, 1) != ACCEPT:
                raise HandshakeRefused("the target did not accept the proof")
        except (ConnectionError, TimeoutError, OSError) as exc:
            if isinstance(exc, HandshakeRefused):
                raise
            raise HandshakeClosed(f"the target closed the handshake ({exc}): pushed out "
                                   "by newer connections, or timed out") from None
        c2s, s2c = session_keys(p.key, nonce_c, nonce_s, data)
        return Sealer(c2s, encrypt=self.encrypt), Opener(s2c, encrypt=self.encrypt)

    def send(self, *, addr: int, rkey: int, offset: int, data: memoryview,
             op: int = OP_WRITE) -> concurrent.futures.Future:
        """Send one frame (blocking until it is on the socket); the future gives its ack
        status, or fails with ChannelLost."""
        codec, payload = self.codec.compress(data)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.lost is not None:
                raise ChannelLost(f"connection already lost: {self.lost}")
            self._seq += 1
            header = Header(op=op, codec=codec, seq=self._seq, addr=addr, rkey=rkey,
                            offset=offset, raw_len=len(data))
            prefix, sealed, body = self._sealer.seal_frame(header, memoryview(payload))
            self._pending[self._seq] = fut
            try:
                sendmsg_all(self._sock, [prefix, sealed, body])
            except OSError as exc:
                self._lose(exc)
        return fut

    def _read_acks(self) -> None:
        try:
            while True:
                frame_seq, status = self._opener.open_ack(recv_exact(self._sock,
                                                                     SEALED_ACK_BYTES))
                with self._lock:
                    fut = self._pending.pop(frame_seq, None)
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_result(status)  # (a cancelled frame's ack is dropped)
        except (OSError, ConnectionError, WireError) as exc:
            self._lose(exc)

    def _lose(self, exc: BaseException) -> None:
        with self._lock:
            if self.lost is None:
                self.lost = exc
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(ChannelLost(f"connection lost with the frame in flight: "
                                              f"{exc}"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._lose(ChannelLost("closed by this writer"))
