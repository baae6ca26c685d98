"""The writer's side of one ``tcp`` link: a connection that proves its key, then frames.

:class:`Channel` connects and runs the handshake of :mod:`.wire`
(:func:`client_handshake`; it checks the server's proof too: a process that does not
hold the link key cannot pose as the target), in the mode :mod:`.encryption` decides for
the connection's two addresses, then sends frames with ``sendmsg`` (scatter-gather: the
sealed header and the source bytes themselves, no copy in the plain mode)
under one lock (sequence numbers go out in order) and reads the sealed acks on
a thread of its own, which resolves one future per frame. A lost connection
fails every frame in flight with :class:`ChannelLost`; the transport opens a
new channel for the next write. :func:`with_backoff` tries a connect again (jittered
exponential backoff) while the target is not listening, resets or closes the handshake.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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

T = TypeVar("T")
BACKOFF_S = 0.02  # the first wait between connect tries (at most)
MAX_BACKOFF_S = 1.0
# One TCP connect: a SYN that a flooded target's full accept queue dropped is sent again
# by the kernel only after 1 s, then 3 s, 7 s; a fresh connect after this is sooner.
CONNECT_TRY_S = 0.5


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


def connect_backoff_s(attempt: int) -> float:
    """How long to wait before try ``attempt + 2`` of a connect: exponential from
    :data:`BACKOFF_S` up to :data:`MAX_BACKOFF_S`, drawn uniformly below that (jitter:
    writers refused together do not come back together)."""
    return random.uniform(0.0, min(MAX_BACKOFF_S, BACKOFF_S * 2.0 ** min(attempt, 32)))


class ConnectTimeout(ConnectionError):
    """No connection within the time given, after several tries (the last error named)."""


def with_backoff(open_: Callable[[float], T], *, timeout_s: float) -> T:
    """``open_(seconds left)``, tried again after a :func:`connect_backoff_s` wait when the
    target is not listening (yet), resets, times out or closes the handshake (a flood
    pushed it out), until ``timeout_s``: then :class:`ConnectTimeout`. A target that did
    not prove the key (:class:`HandshakeRefused`) fails at once."""
    deadline = time.monotonic() + timeout_s
    for attempt in itertools.count():
        try:
            return open_(max(deadline - time.monotonic(), 0.01))
        except HandshakeClosed as exc:  # before HandshakeRefused: its subclass
            error: Exception = exc
        except HandshakeRefused:
            raise
        except OSError as exc:  # refused, reset, timed out
            error = exc
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectTimeout(f"no authenticated connection within {timeout_s:g} s "
                                 f"({attempt + 1} tries): {error}") from None
        time.sleep(min(left, connect_backoff_s(attempt)))
    raise AssertionError("unreachable")


def client_handshake(sock: socket.socket, *, key: bytes, mode: int, codec: int,
                     writer_id: bytes, target_id: bytes) -> tuple[Sealer, Opener]:
    """The writer's side of the handshake (:mod:`.wire`, steps 1-4) on a connected
    socket: the sealer of what it sends, the opener of what it receives.
    HandshakeRefused if the target does not prove ``key``; HandshakeClosed if it closes."""
    nonce_c = os.urandom(NONCE_BYTES)
    sock.sendall(pack_hello(mode, codec, nonce_c, writer_id))
    try:
        nonce_s = recv_exact(sock, NONCE_BYTES)
        server_proof = recv_exact(sock, PROOF_BYTES)
        data = transcript(mode, codec, nonce_c, nonce_s, writer_id, target_id)
        if not check_proof(key, b"server", data, server_proof):
            raise HandshakeRefused("the target did not prove the link key (another "
                                   "key, or another mode or codec)")
        sock.sendall(proof(key, b"client", data))
        if recv_exact(sock, 1) != ACCEPT:
            raise HandshakeRefused("the target did not accept the proof")
    except (ConnectionError, TimeoutError, OSError) as exc:
        if isinstance(exc, HandshakeRefused):
            raise
        raise HandshakeClosed(f"the target closed the handshake ({exc}): pushed out "
                               "by newer connections, or timed out") from None
    c2s, s2c = session_keys(key, nonce_c, nonce_s, data)
    encrypt = mode == MODE_ENCRYPT
    return Sealer(c2s, encrypt=encrypt), Opener(s2c, encrypt=encrypt)


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

    def __init__(self, params: LinkParams, *, timeout_s: float | None = None) -> None:
        """Connect and authenticate within ``timeout_s`` (default ``connect_timeout_s``)."""
        self.params = params
        self.codec = Codec(params.codec, params.level)
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._seq = 0
        self.lost: BaseException | None = None
        timeout_s = timeout_s or params.connect_timeout_s
        self._sock = socket.create_connection((params.host, params.port),
                                              timeout=min(timeout_s, CONNECT_TRY_S))
        try:
            self._sock.settimeout(timeout_s)  # the handshake may wait behind a flood
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
        return client_handshake(self._sock, key=p.key, mode=MODE_ENCRYPT if self.encrypt
                                else MODE_PLAIN, codec=self.codec.id, writer_id=p.writer_id,
                                target_id=p.target_id)

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
