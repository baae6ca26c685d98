"""The listener of a ``tcp`` target NIC: a :class:`~.gate.Gate`, then a thread per session.

It binds only the advertised address (a wildcard address is refused). The gate
runs every connection's handshake (:mod:`.wire`) on one selector thread, with a
deadline (``handshake_timeout_s``) and at most ``max_pending`` at once (a new one
pushes out the oldest), so neither idle connections nor a churning flood keep a
planned writer out, and gives every name the same challenge (no oracle). Only a
connection that proved its writer's key gets a thread: it reads frames into one
reusable buffer (never into registered memory: a frame is trusted only once
authenticated), opens them, decompresses, and has the
:class:`~.target.TargetTable` check and copy; each frame gets a sealed ack. A
frame that fails authentication ends its session. Refusals are counted and
logged by the table (at most once per remote host per interval).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

from weight_transfer.sync.listen import check_listen_address
from weight_transfer.transport.tcp.codec import Codec, CodecError
from weight_transfer.transport.tcp.encryption import link_encrypts
from weight_transfer.transport.tcp.gate import Gate, Proven, Rules
from weight_transfer.transport.tcp.target import TargetTable
from weight_transfer.transport.tcp.wire import (
    BAD_OP,
    BAD_PAYLOAD,
    CODECS,
    MODE_ENCRYPT,
    MODE_PLAIN,
    OP_WRITE,
    PREFIX,
    SEALED_HEADER_BYTES,
    TAG_BYTES,
    Opener,
    Sealer,
    WireError,
)

log = logging.getLogger(__name__)


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
        self.max_payload = max_payload
        self._lock = threading.Lock()
        self._sessions: dict[socket.socket, bytes] = {}
        self._closed = False
        rules = Rules(target_id=target_id, key_for=table.key_for, mode_for=self._mode_for,
                      codec=self.codec.id, settings=f"encrypt={encrypt}, {self.codec.name}")
        self._gate = Gate(rules, host=check_bind_host(host), port=port,
                          handshake_timeout_s=handshake_timeout_s, max_pending=max_pending,
                          on_session=self._start, on_refuse=self._refused,
                          name="wt-tcp-gate")
        self.host, self.port = host, self._gate.port

    @property
    def gate(self) -> Gate:
        return self._gate

    def _mode_for(self, local: str, peer: str) -> int:
        """The mode a connection must use: encrypted or not by the ``encrypt`` option
        and, when it is unset, by whether both ends have one address (.encryption)."""
        return MODE_ENCRYPT if link_encrypts(self.encrypt, local, peer) else MODE_PLAIN

    def _refused(self, peer: str, host: str, reason: str) -> None:
        self.table.refuse("connection", peer, reason, source=host)

    def _start(self, conn: socket.socket, proven: Proven) -> None:
        """A writer proved its key (on the gate's thread): its session gets a thread."""
        session = _Session(proven.writer, proven.who,
                           Opener(proven.c2s, encrypt=proven.encrypt),
                           Sealer(proven.s2c, encrypt=proven.encrypt))
        with self._lock:
            if self._closed:
                _close(conn)
                return
            self._sessions[conn] = proven.writer
        log.info("%s: writer %s authenticated (%s)", self.table.label, proven.who,
                 "encrypted" if proven.encrypt else "authenticated, in clear")
        threading.Thread(target=self._serve, args=(conn, session), daemon=True,
                         name="wt-tcp-session").start()

    def _serve(self, conn: socket.socket, session: _Session) -> None:
        try:
            self._frames(conn, session)
        except (ConnectionError, OSError, TimeoutError):
            pass  # the writer went away or the session was closed here
        finally:
            with self._lock:
                self._sessions.pop(conn, None)
            _close(conn)

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
        self._gate.close()
        with self._lock:
            self._closed = True
            conns = list(self._sessions)
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
