"""The listener of a ``tcp`` target NIC: one accept thread, one thread per connection.

It binds only the advertised address (a wildcard address is refused). Each
connection must finish the handshake (:mod:`._tcp_wire`) before a deadline
(``handshake_timeout_s``); at most ``max_pending`` connections may be in their
handshake at once, and a new one pushes out the oldest, so idle connections
never keep a planned writer out. Every name gets the same challenge (a name the
plan gave no key, or another mode, is challenged under a random key), so a
refusal always comes at the proof step and tells an outsider nothing about
which writers or which mode this NIC accepts. An authenticated session then reads frames
into one reusable buffer (never into registered memory: a frame is trusted
only once authenticated), opens them, decompresses, and has the
:class:`~._tcp_target.TargetTable` check and copy; each frame gets a sealed ack.
A frame that fails authentication ends its session. Refusals are counted and
logged by the table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

from weight_transfer.sync.listen import check_listen_address
from weight_transfer.transport.tcp.codec import Codec, CodecError
from weight_transfer.transport.tcp.encryption import link_encrypts
from weight_transfer.transport.tcp.target import TargetTable
from weight_transfer.transport.tcp.wire import (
    ACCEPT,
    BAD_OP,
    BAD_PAYLOAD,
    CODECS,
    HELLO,
    MODE_ENCRYPT,
    MODE_PLAIN,
    NONCE_BYTES,
    OP_WRITE,
    PREFIX,
    PROOF_BYTES,
    SEALED_HEADER_BYTES,
    TAG_BYTES,
    Opener,
    Sealer,
    WireError,
    check_proof,
    proof,
    session_keys,
    transcript,
    unpack_hello_head,
)

log = logging.getLogger(__name__)


class Refused(Exception):
    """A connection refused during the handshake (the reason is logged and counted)."""


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes, or ConnectionError at EOF / TimeoutError past ``deadline``."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        got += n


def check_bind_host(host: str) -> str:
    """``host`` if it names one address; ValueError for an empty or wildcard one."""
    return check_listen_address(host, what="tcp transport")


class _Session:
    """An authenticated connection: its writer, its keys and its reusable buffer."""

    def __init__(self, writer: bytes, who: str, opener: Opener, sealer: Sealer) -> None:
        self.writer, self.who, self.opener, self.sealer = writer, who, opener, sealer


class Listener:
    """See the module docstring. ``target_id`` names this NIC in the handshake."""

    def __init__(self, table: TargetTable, *, host: str, port: int, target_id: bytes,
                 encrypt: bool | None, codec: str, max_payload: int,
                 handshake_timeout_s: float, max_pending: int) -> None:
        self.table, self.target_id = table, target_id
        self.encrypt, self.codec = encrypt, Codec(codec)  # encrypt: see .encryption
        self.max_payload, self.max_pending = max_payload, max_pending
        self.handshake_timeout_s = handshake_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((check_bind_host(host), port))
        self._sock.listen(512)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._pending: dict[socket.socket, float] = {}
        self._sessions: dict[socket.socket, bytes] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"wt-tcp-accept-{self.port}")
        self._thread.start()

    # ------------------------------------------------------------------ accept

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._admit(conn)
            threading.Thread(target=self._serve, args=(conn, f"{addr[0]}:{addr[1]}"),
                             daemon=True, name="wt-tcp-conn").start()

    def _admit(self, conn: socket.socket) -> None:
        """Record a connection in its handshake; push out the oldest one when full."""
        with self._lock:
            oldest = None
            if len(self._pending) >= self.max_pending:
                oldest = min(self._pending, key=self._pending.__getitem__)
                del self._pending[oldest]
            self._pending[conn] = time.monotonic()
        if oldest is not None:
            _shut(oldest)

    def _serve(self, conn: socket.socket, addr: str) -> None:
        try:
            session = self._handshake(conn, addr)
        except (Refused, WireError, OSError, TimeoutError, ValueError) as exc:
            reason = "handshake timed out" if isinstance(exc, TimeoutError) else str(exc)
            if not self._closed:
                self.table.refuse("connection", addr, reason or type(exc).__name__)
            self._forget(conn)
            _close(conn)
            return
        try:
            conn.settimeout(None)
            self._frames(conn, session)
        except (ConnectionError, OSError, TimeoutError):
            pass  # the writer went away or the session was closed here
        finally:
            self._forget(conn)
            _close(conn)

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            self._sessions.pop(conn, None)

    # ------------------------------------------------------------------ handshake

    def _handshake(self, conn: socket.socket, addr: str) -> _Session:
        deadline = time.monotonic() + self.handshake_timeout_s
        mode, codec, id_len = unpack_hello_head(recv_exact(conn, HELLO.size, deadline))
        nonce_c = recv_exact(conn, NONCE_BYTES, deadline)
        writer = recv_exact(conn, id_len, deadline)
        who = f"{writer.decode(errors='replace').replace(chr(0), '/')} at {addr}"
        want = self._mode_for(conn)
        key, why = self._key_or_reason(writer, mode, codec, want)
        # No oracle: a name without a key (or another mode) gets the same challenge under a
        # random key, so it fails at the proof step exactly as a wrong key does.
        decoy = os.urandom(32)  # drawn for every name: the same work either way
        used = decoy if why else key
        nonce_s = os.urandom(NONCE_BYTES)
        data = transcript(mode, codec, nonce_c, nonce_s, writer, self.target_id)
        conn.sendall(nonce_s + proof(used, b"server", data))
        proved = check_proof(used, b"client", data, recv_exact(conn, PROOF_BYTES, deadline))
        if why or not proved:
            raise Refused(f"{who} failed the challenge ({why or 'wrong key'})")
        with self._lock:
            if self._pending.pop(conn, None) is None:
                raise Refused(f"{who} was pushed out by newer connections")
            self._sessions[conn] = writer
        conn.sendall(ACCEPT)
        c2s, s2c = session_keys(key, nonce_c, nonce_s, data)
        encrypt = mode == MODE_ENCRYPT
        log.info("%s: writer %s authenticated (%s)", self.table.label, who,
                 "encrypted" if encrypt else "authenticated, in clear")
        return _Session(writer, who, Opener(c2s, encrypt=encrypt), Sealer(s2c, encrypt=encrypt))

    def _mode_for(self, conn: socket.socket) -> int:
        """The mode this connection must use: encrypted or not by the ``encrypt`` option
        and, when it is unset, by whether both ends have one address (.encryption)."""
        local, peer = conn.getsockname()[0], conn.getpeername()[0]
        return MODE_ENCRYPT if link_encrypts(self.encrypt, local, peer) else MODE_PLAIN

    def _key_or_reason(self, writer: bytes, mode: int, codec: int,
                       want: int) -> tuple[bytes, str]:
        """The link key of ``writer``, or why it has none here (logged, never sent)."""
        if (mode, codec) != (want, self.codec.id):
            return b"", (f"asked for mode {mode}, codec {codec}; this link uses mode {want} "
                         f"(encrypt={self.encrypt}), codec {self.codec.id} ({self.codec.name})")
        key = self.table.key_for(writer)
        if key is None:
            return b"", "not a writer the plan gave a key for"
        return key, ""

    # ------------------------------------------------------------------ frames

    def _frames(self, conn: socket.socket, s: _Session) -> None:
        buf = memoryview(bytearray(self.max_payload))
        while True:
            (n,) = PREFIX.unpack(recv_exact(conn, PREFIX.size))
            if n > self.max_payload:
                self.table.refuse("write", s.who, f"frame of {n} B is larger than "
                                  f"{self.max_payload} B; session closed")
                return
            sealed = recv_exact(conn, SEALED_HEADER_BYTES)
            recv_into_exact(conn, buf[:n])
            try:
                header, plain = s.opener.open_frame(sealed, buf[:n])
            except WireError as exc:
                self.table.refuse("write", s.who, f"{exc}; session closed")
                return
            status = self._apply(s, header, plain)
            conn.sendall(s.sealer.seal_ack(header.seq, status))

    def _apply(self, s: _Session, header: Any, plain: memoryview) -> int:
        if header.op != OP_WRITE:
            self.table.refuse("write", s.who, f"operation {header.op} (only WRITE exists)")
            return BAD_OP
        if header.raw_len > self.max_payload or header.codec not in CODECS.values():
            self.table.refuse("write", s.who, f"raw length {header.raw_len} or codec "
                              f"{header.codec} not allowed")
            return BAD_PAYLOAD
        try:
            data = self.codec.decompress(header.codec, plain, header.raw_len)
        except CodecError as exc:
            self.table.refuse("write", s.who, str(exc))
            return BAD_PAYLOAD
        return self.table.apply(s.writer, s.who, header, data)

    # ------------------------------------------------------------------ teardown

    def drop_writer(self, writer: bytes) -> int:
        """Close the sessions of ``writer`` (its key was replaced); returns how many."""
        with self._lock:
            conns = [c for c, w in self._sessions.items() if w == writer]
        for conn in conns:
            _shut(conn)
        return len(conns)

    def close(self) -> None:
        self._closed = True
        _shut(self._sock)
        _close(self._sock)
        with self._lock:
            conns = list(self._pending) + list(self._sessions)
        for conn in conns:
            _shut(conn)


def max_payload_for(chunk_bytes: int) -> int:
    """The largest frame payload a chunk makes (a raw chunk plus the encryption tag)."""
    return chunk_bytes + TAG_BYTES


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
