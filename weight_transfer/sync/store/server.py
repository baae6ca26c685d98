"""The barrier store's server: small values, the setup's keys only, key holders only.

::

    server = StoreServer(host="10.0.0.7", link_key=store_key(key),
                         namespace=namespace(key), target_id=store_identity(key))
    server.port; ...; server.close()

:class:`~.process.BarrierStore` runs it in a process of its own
(``python -m weight_transfer.sync.store.server``, its settings on stdin, its port
on stdout, serving until its stdin closes), so nothing sent to it can exhaust the
controller. Connections go through a :class:`~weight_transfer.transport.tcp.gate.Gate`
(one selector thread for every connection until it proves the store key, a
deadline, at most ``max_pending`` at once, the oldest pushed out first): a flood
costs no thread. A connection that proved the key gets a thread that answers its
requests in order. The data is one dict under one lock; a ``wait`` or ``get``
blocks its session's thread until its keys exist or its timeout passes (each
waiter is woken only by the keys it waits for). Every limit of :mod:`.protocol` is
checked before anything is stored; a refused request is answered REFUSED with the
reason, counted (:attr:`StoreServer.refused`) and logged at most once per client
per interval.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable

from weight_transfer.observe.throttle import LogThrottle
from weight_transfer.sync.store.protocol import (
    ADD,
    CHECK,
    COMPARE_SET,
    DELETE,
    ENTRY_BYTES,
    GET,
    MAX_KEY_BYTES,
    MAX_STORE_BYTES,
    MAX_VALUE_BYTES,
    NUM_KEYS,
    OK,
    OP_NAMES,
    REFUSED,
    SET,
    TIMED_OUT,
    WAIT,
    recv_message,
    send_message,
)
from weight_transfer.transport.tcp.gate import Gate, Proven, Rules
from weight_transfer.transport.tcp.wire import MODE_ENCRYPT, Opener, Sealer, WireError

log = logging.getLogger(__name__)

MAX_WAIT_S = 86400.0


class Refusal(Exception):
    """A request the store refuses (the message names what and which limit)."""


class _Waiter:
    __slots__ = ("event", "missing")

    def __init__(self, missing: set[str]) -> None:
        self.missing, self.event = missing, threading.Event()


class StoreServer:
    """See the module docstring."""

    def __init__(self, *, host: str, link_key: bytes, namespace: str, target_id: bytes,
                 port: int = 0, max_bytes: int = MAX_STORE_BYTES,
                 handshake_timeout_s: float = 2.0, max_pending: int = 64) -> None:
        self.namespace, self.max_bytes = namespace, max_bytes
        self.refused = 0  # requests refused (a limit, the namespace, a malformed message)
        self.used = 0  # bytes counted against max_bytes
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, list[_Waiter]] = {}
        self._lock = threading.Lock()
        self._throttle = LogThrottle()
        self._ops: dict[int, Callable[[list[bytes]], list[bytes]]] = {
            SET: self._set, GET: self._get, WAIT: self._wait, CHECK: self._check,
            ADD: self._add, COMPARE_SET: self._compare_set, DELETE: self._delete,
            NUM_KEYS: self._num_keys}
        rules = Rules(target_id=target_id, key_for=lambda _who: link_key,
                      mode_for=lambda _local, _peer: MODE_ENCRYPT, codec=0,
                      settings="barrier store: encrypted, no compression")
        self.refused_connections = 0
        self._gate = Gate(rules, host=host, port=port, handshake_timeout_s=handshake_timeout_s,
                          max_pending=max_pending, on_session=self._start,
                          on_refuse=self._refused_connection, name="wt-barrier-store")
        self.host, self.port = host, self._gate.port

    # ------------------------------------------------------------------ connections

    def _refused_connection(self, peer: str, host: str, reason: str) -> None:
        self.refused_connections += 1  # the gate's one thread: no lock needed
        self._log(("connection", host), "a connection from %s: %s", peer, reason)

    def _start(self, conn: socket.socket, proven: Proven) -> None:
        threading.Thread(target=self._serve, args=(conn, proven), daemon=True,
                         name="wt-barrier-store-session").start()

    def _serve(self, conn: socket.socket, proven: Proven) -> None:
        opener = Opener(proven.c2s, encrypt=proven.encrypt)
        sealer = Sealer(proven.s2c, encrypt=proven.encrypt)
        try:
            while True:
                op, items = recv_message(conn, opener)
                status, reply = self._answer(op, items, proven.who)
                send_message(conn, sealer, status, reply)
        except (ConnectionError, TimeoutError):
            pass  # the client went away
        except (OSError, WireError, ValueError) as exc:  # a broken or oversized message
            self._refuse(proven.who, f"session closed: {exc}")
        finally:
            conn.close()

    def _answer(self, op: int, items: list[bytes], who: str) -> tuple[int, list[bytes]]:
        handler = self._ops.get(op)
        try:
            if handler is None:
                raise Refusal(f"unknown operation {op}")
            return OK, handler(items)
        except Refusal as exc:
            reason = f"{OP_NAMES.get(op, op)} refused: {exc}"
            self._refuse(who, reason)
            return REFUSED, [reason.encode()]
        except TimeoutError as exc:
            return TIMED_OUT, [str(exc).encode()]

    def _refuse(self, who: str, reason: str) -> None:
        with self._lock:
            self.refused += 1
        self._log(("request", who), "a request of %s: %s", who, reason)

    def _log(self, source: tuple[str, str], what: str, *args: object) -> None:
        """Log a refusal unless ``source`` was logged within the throttle's interval."""
        skipped = self._throttle.due(source)
        if skipped is not None:
            log.warning("barrier store %s refused " + what + " (%d more from %s not logged "
                        "before; at most one line per %g s)", self.namespace, *args, skipped,
                        source[1], self._throttle.every_s)

    # ------------------------------------------------------------------ checks

    def _key(self, raw: bytes) -> str:
        if len(raw) > MAX_KEY_BYTES:
            raise Refusal(f"a key of {len(raw)} B (at most {MAX_KEY_BYTES} B)")
        key = raw.decode("utf-8", errors="replace")
        if not key.startswith(self.namespace):
            raise Refusal(f"key {key[:80]!r} is outside this setup's namespace "
                          f"{self.namespace!r}")
        return key

    @staticmethod
    def _items(items: list[bytes], n: int, what: str) -> list[bytes]:
        if len(items) != n:
            raise Refusal(f"{what} takes {n} items, got {len(items)}")
        return items

    def _put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` within the limits (the lock is held)."""
        if len(value) > MAX_VALUE_BYTES:
            raise Refusal(f"a value of {len(value)} B for {key[:80]!r} (at most "
                          f"{MAX_VALUE_BYTES} B)")
        old = self._data.get(key)
        cost = ENTRY_BYTES + len(key.encode()) + len(value)
        used = self.used + cost - (0 if old is None else
                                   ENTRY_BYTES + len(key.encode()) + len(old))
        if used > self.max_bytes:
            raise Refusal(f"storing {key[:80]!r} would make the store hold {used} B, over "
                          f"its cap of {self.max_bytes} B (keys + values + {ENTRY_BYTES} B "
                          "per key)")
        self._data[key], self.used = value, used
        for waiter in self._waiters.pop(key, ()):
            waiter.missing.discard(key)
            if not waiter.missing:
                waiter.event.set()

    # ------------------------------------------------------------------ operations

    def _set(self, items: list[bytes]) -> list[bytes]:
        key, value = self._items(items, 2, "set")
        with self._lock:
            self._put(self._key(key), value)
        return []

    def _waited(self, items: list[bytes]) -> tuple[float, list[str]]:
        """``(timeout in s, keys)`` of a wait or get: ``items[0]`` is the timeout in ms."""
        try:
            timeout_s = min(int(items[0]) / 1000.0, MAX_WAIT_S)
        except (IndexError, ValueError):
            raise Refusal("a wait or get starts with its timeout in ms") from None
        return timeout_s, [self._key(k) for k in items[1:]]

    def _await(self, keys: list[str], timeout_s: float) -> None:
        """Block until every key exists; TimeoutError naming the missing ones."""
        with self._lock:
            waiter = _Waiter({k for k in keys if k not in self._data})
            for key in waiter.missing:
                self._waiters.setdefault(key, []).append(waiter)
        if not waiter.missing or waiter.event.wait(timeout_s):
            return
        with self._lock:
            missing = sorted(waiter.missing)
            for key in missing:
                left = [w for w in self._waiters.get(key, ()) if w is not waiter]
                if left:
                    self._waiters[key] = left
                else:
                    self._waiters.pop(key, None)
        if missing:  # else the last key came just as the wait gave up
            raise TimeoutError(f"keys {missing[:4]}{' ...' if len(missing) > 4 else ''} not "
                               f"set within {timeout_s:g} s")

    def _wait(self, items: list[bytes]) -> list[bytes]:
        self._await(*reversed(self._waited(items)))
        return []

    def _get(self, items: list[bytes]) -> list[bytes]:
        timeout_s, keys = self._waited(items)
        deadline = time.monotonic() + timeout_s
        while True:
            self._await(keys, max(deadline - time.monotonic(), 0.0))
            with self._lock:
                if all(k in self._data for k in keys):
                    return [self._data[k] for k in keys]
            # a key was deleted between the wait and the read: wait again

    def _check(self, items: list[bytes]) -> list[bytes]:
        keys = [self._key(k) for k in items]
        with self._lock:
            return [b"1" if all(k in self._data for k in keys) else b"0"]

    def _add(self, items: list[bytes]) -> list[bytes]:
        raw, amount = self._items(items, 2, "add")
        key = self._key(raw)
        with self._lock:
            old = self._data.get(key, b"0")
            try:
                value = int(old) + int(amount)
            except ValueError:
                raise Refusal(f"add to {key[:80]!r}: {old[:20]!r} + {amount[:20]!r} are not "
                              "both integers") from None
            self._put(key, str(value).encode())
        return [str(value).encode()]

    def _compare_set(self, items: list[bytes]) -> list[bytes]:
        raw, expected, desired = self._items(items, 3, "compare_set")
        key = self._key(raw)
        with self._lock:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._put(key, desired)
                return [desired]
            return [expected if current is None else current]

    def _delete(self, items: list[bytes]) -> list[bytes]:
        (raw,) = self._items(items, 1, "delete_key")
        key = self._key(raw)
        with self._lock:
            value = self._data.pop(key, None)
            if value is not None:
                self.used -= ENTRY_BYTES + len(key.encode()) + len(value)
        return [b"1" if value is not None else b"0"]

    def _num_keys(self, items: list[bytes]) -> list[bytes]:
        self._items(items, 0, "num_keys")
        with self._lock:
            return [str(len(self._data)).encode()]

    def num_keys(self) -> int:
        with self._lock:
            return len(self._data)

    def close(self) -> None:
        self._gate.close()


def main() -> None:
    """The store's own process: settings (JSON) on stdin, ``{"port": p}`` on stdout, then
    serve until stdin closes (the owner closed it, or died)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = json.loads(sys.stdin.readline())
    server = StoreServer(host=cfg["host"], link_key=bytes.fromhex(cfg["link_key"]),
                         namespace=cfg["namespace"], target_id=bytes.fromhex(cfg["target_id"]),
                         max_bytes=cfg["max_bytes"], max_pending=cfg["max_pending"],
                         handshake_timeout_s=cfg["handshake_timeout_s"])
    print(json.dumps({"port": server.port}), flush=True)
    sys.stdin.read()
    server.close()


if __name__ == "__main__":
    main()
