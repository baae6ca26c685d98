"""The first half of a listener of ours: every connection until it proves a key, on one thread.

A :class:`Gate` binds one address (a wildcard is refused), accepts without
blocking and runs each connection's handshake (:mod:`.wire`, steps 1-3: HELLO,
CHALLENGE, PROOF, then ACCEPT) as a small state machine on one selector thread,
so a flood of connections costs a socket and a few hundred bytes each, never a
thread. Each turn of the loop, in order:

1. connections with bytes (or an end) to read advance: a complete HELLO gets its
   challenge, a complete PROOF is checked; one that proved its key is answered
   ACCEPT, made blocking and handed to ``on_session`` (which may start a thread:
   only holders of a key get there);
2. at most :data:`ACCEPT_BATCH` new connections are accepted, each advanced at
   once with what it sent already (a churned connection, closed as soon as made,
   is dropped there, never polled); with ``max_pending`` in their handshake, each
   new one pushes out the oldest;
3. connections past their deadline (``handshake_timeout_s`` after the accept) are
   dropped.

No oracle: every name gets the same challenge (a name ``key_for`` gives no key,
or another mode or codec, is challenged under a random key), so a refusal always
comes at the proof step, as for a wrong key. Every refused connection goes to
``on_refuse(peer, host, reason)`` (the listener counts it and logs it, throttled).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from weight_transfer.sync.listen import check_listen_address
from weight_transfer.transport.tcp.wire import (
    ACCEPT,
    HELLO,
    MODE_ENCRYPT,
    NONCE_BYTES,
    PROOF_BYTES,
    WireError,
    check_proof,
    proof,
    session_keys,
    transcript,
    unpack_hello_head,
)

log = logging.getLogger(__name__)

ACCEPT_BATCH = 64  # then connections waiting for their next message have their turn
BACKLOG = 512  # the kernel's queue of finished TCP handshakes: short, so a SYN waits little


@dataclass(frozen=True, slots=True, kw_only=True)
class Proven:
    """A connection that proved its key: its identity and its session keys."""

    writer: bytes
    who: str  # the identity and the remote address, for messages
    encrypt: bool
    c2s: bytes
    s2c: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Rules:
    """What a gate accepts: ``key_for(identity)`` gives a writer's key (None: no key);
    ``mode_for(local, peer)`` the mode a connection between those addresses must use;
    ``codec`` the one codec id; ``settings`` names both for the logs."""

    target_id: bytes
    key_for: Callable[[bytes], bytes | None]
    mode_for: Callable[[str, str], int]
    codec: int
    settings: str


class Refused(Exception):
    """A connection refused during its handshake (the message is the reason)."""


class _Pending:
    """One connection in its handshake: what it sent so far and what it waits for."""

    __slots__ = ("buf", "deadline", "hello", "host", "need", "peer", "sock", "step")

    def __init__(self, sock: socket.socket, addr: tuple, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.host, self.peer = addr[0], f"{addr[0]}:{addr[1]}"
        self.buf, self.need, self.step = bytearray(), HELLO.size, 0
        self.hello: tuple = ()  # after step 1: (mode, codec, writer, who, key, why, ...)


def printable(text: str) -> str:
    """``text`` with control characters replaced (an outsider's name goes into logs)."""
    return "".join(c if c.isprintable() else "?" for c in text)


class Gate:
    """See the module docstring. ``port`` 0: a free one (read :attr:`port`)."""

    def __init__(self, rules: Rules, *, host: str, port: int, handshake_timeout_s: float,
                 max_pending: int, on_session: Callable[[socket.socket, Proven], None],
                 on_refuse: Callable[[str, str, str], None], name: str = "wt-gate") -> None:
        self.rules, self.max_pending = rules, max_pending
        self.handshake_timeout_s = handshake_timeout_s
        self.on_session, self.on_refuse = on_session, on_refuse
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((check_listen_address(host, what=name), port))
            self._sock.listen(BACKLOG)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self.host, self.port = host, self._sock.getsockname()[1]
        self._pending: dict[socket.socket, _Pending] = {}  # in accept order: oldest first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"{name}-{self.port}")
        self._thread.start()

    @property
    def bound(self) -> tuple[str, int]:
        """The address and port the listening socket is bound to."""
        return self._sock.getsockname()[:2]

    @property
    def pending(self) -> int:
        """Connections in their handshake now."""
        return len(self._pending)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            while not self._closed:
                events = self._sel.select(self._wait_s())
                accept = False
                for key, _ in events:
                    if key.data == "accept":
                        accept = True
                    elif isinstance(key.data, _Pending):
                        self._step(key.data)
                if accept and not self._closed:
                    self._accept()
                self._expire()
        finally:
            self._teardown()

    def _step(self, p: _Pending) -> None:
        try:
            self._advance(p)
        except Exception as exc:  # a bug, or no thread left for a session: this one only
            log.exception("%s: connection from %s dropped", self._thread.name, p.peer)
            self._drop(p, f"internal error: {exc!r}")

    def _wait_s(self) -> float | None:
        first = next(iter(self._pending.values()), None)
        return None if first is None else max(0.0, first.deadline - time.monotonic())

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: make room, try next turn
                if self._pending:
                    self._drop(next(iter(self._pending.values())), f"pushed out ({exc})")
                return
            sock.setblocking(False)
            if len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending.values())),
                           f"pushed out by newer connections (at most {self.max_pending} "
                           "in their handshake)")
            p = _Pending(sock, addr, time.monotonic() + self.handshake_timeout_s)
            self._pending[sock] = p
            # What a connection sent (or its end) is usually there already: a churned one
            # is dropped here, without ever being polled.
            self._step(p)
            if sock in self._pending:
                self._sel.register(sock, selectors.EVENT_READ, p)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            first = next(iter(self._pending.values()))
            if first.deadline > now:
                return
            self._drop(first, "handshake timed out")

    def _drop(self, p: _Pending, reason: str) -> None:
        """Count the refusal, then close (a peer that sees the close sees it counted)."""
        self._forget(p)
        try:
            if not self._closed:
                self.on_refuse(p.peer, p.host, reason)
        except Exception:  # counting must not stop the gate
            log.exception("%s: refusal of %s not recorded", self._thread.name, p.peer)
        finally:
            _close(p.sock)

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(p.sock)

    # ------------------------------------------------------------------ one handshake

    def _advance(self, p: _Pending) -> None:
        """Read what ``p`` sent; a complete message moves it one step."""
        try:
            chunk = p.sock.recv(p.need - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(p, f"connection error in the handshake: {exc}")
            return
        if not chunk:
            self._drop(p, "closed by the peer before finishing the handshake")
            return
        p.buf += chunk
        if len(p.buf) < p.need:
            return
        data, p.buf = bytes(p.buf), bytearray()
        try:
            (self._on_head, self._on_hello, self._on_proof)[p.step](p, data)
        except (Refused, WireError, OSError) as exc:
            self._drop(p, str(exc) or type(exc).__name__)

    def _on_head(self, p: _Pending, data: bytes) -> None:
        mode, codec, id_len = unpack_hello_head(data)
        p.hello, p.need, p.step = (mode, codec), NONCE_BYTES + id_len, 1

    def _on_hello(self, p: _Pending, data: bytes) -> None:
        (mode, codec), nonce_c, writer = p.hello, data[:NONCE_BYTES], data[NONCE_BYTES:]
        who = f"{printable(writer.decode(errors='replace').replace(chr(0), '/'))} at {p.peer}"
        want = self.rules.mode_for(p.sock.getsockname()[0], p.host)
        key, why = self._key_or_reason(writer, mode, codec, want)
        # No oracle: a name without a key (or another mode) is challenged under a random
        # key, so it fails at the proof step exactly as a wrong key does.
        decoy = os.urandom(32)  # drawn for every name: the same work either way
        used = decoy if why else key
        nonce_s = os.urandom(NONCE_BYTES)
        seen = transcript(mode, codec, nonce_c, nonce_s, writer, self.rules.target_id)
        challenge = nonce_s + proof(used, b"server", seen)
        if p.sock.send(challenge) != len(challenge):  # 64 bytes into a fresh socket
            raise Refused(f"{who} did not take the {len(challenge)}-byte challenge")
        p.hello = (mode, writer, who, key, why, used, nonce_c, nonce_s, seen)
        p.need, p.step = PROOF_BYTES, 2

    def _on_proof(self, p: _Pending, data: bytes) -> None:
        mode, writer, who, key, why, used, nonce_c, nonce_s, seen = p.hello
        if why or not check_proof(used, b"client", seen, data):
            raise Refused(f"{who} failed the challenge ({why or 'wrong key'})")
        if self.rules.key_for(writer) != key:
            raise Refused(f"{who} proved a key that a newer setup replaced")
        self._forget(p)
        p.sock.setblocking(True)
        p.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        p.sock.sendall(ACCEPT)
        c2s, s2c = session_keys(key, nonce_c, nonce_s, seen)
        self.on_session(p.sock, Proven(writer=writer, who=who, encrypt=mode == MODE_ENCRYPT,
                                       c2s=c2s, s2c=s2c))

    def _key_or_reason(self, writer: bytes, mode: int, codec: int,
                       want: int) -> tuple[bytes, str]:
        """The key of ``writer``, or why it has none here (logged, never sent)."""
        if (mode, codec) != (want, self.rules.codec):
            return b"", (f"asked for mode {mode}, codec {codec}; this link uses mode {want}, "
                         f"codec {self.rules.codec} ({self.rules.settings})")
        key = self.rules.key_for(writer)
        if key is None:
            return b"", "not a writer the plan gave a key for"
        return key, ""

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Stop accepting and drop every connection still in its handshake (sessions
        handed out are their owner's); returns once the port is released."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(30)

    def _teardown(self) -> None:
        for p in list(self._pending.values()):
            self._forget(p)
            _close(p.sock)
        self._sel.close()
        for sock in (self._sock, self._wake_r, self._wake_w):
            _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
