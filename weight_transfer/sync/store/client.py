"""A client of the barrier store: the part of a ``torch.distributed.Store`` the barrier uses.

::

    store = StoreClient("10.0.0.7", port, key=barrier_key, timeout_s=60, who="trainer 3")
    barrier = StoreBarrier(store, rank=3, ranks=range(8), key=barrier_key)

It connects and proves the store key (derived from ``key``, :mod:`.protocol`),
tried again with jittered backoff while the store is flooded, then sends one
request at a time (a lock: threads may share it) and reads its reply. As with
torch's stores, ``get``/``multi_get`` and ``wait`` block until the keys exist
and raise a ``RuntimeError`` (:class:`StoreTimeout`) after the store's timeout;
a request the store refuses (a key outside the setup's namespace, a value over
:data:`~.protocol.MAX_VALUE_BYTES`, a full store) raises ``ValueError`` with the
store's reason. A connection lost in a request raises ``RuntimeError``; the next
request connects again.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from collections.abc import Sequence

from weight_transfer.sync.barrier import BarrierKey
from weight_transfer.sync.store.protocol import (
    ADD,
    CHECK,
    COMPARE_SET,
    DELETE,
    GET,
    NUM_KEYS,
    OK,
    REFUSED,
    SET,
    WAIT,
    recv_message,
    send_message,
    store_identity,
    store_key,
)
from weight_transfer.transport.tcp.client import (
    CONNECT_TRY_S,
    HandshakeRefused,
    client_handshake,
    with_backoff,
)
from weight_transfer.transport.tcp.wire import MODE_ENCRYPT, Opener, Sealer, WireError, identity

REPLY_MARGIN_S = 30.0  # beyond a request's own timeout, for the reply to come


class StoreTimeout(RuntimeError):
    """Keys not set within the timeout (a RuntimeError, like torch's ``DistStoreError``)."""


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class StoreClient:
    """See the module docstring."""

    def __init__(self, host: str, port: int, *, key: BarrierKey, timeout_s: float = 300.0,
                 connect_timeout_s: float = 60.0, who: str = "") -> None:
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"barrier store port must be an integer in (0, 65536), not "
                             f"{port!r}")
        self.host, self.port, self.key = host, port, key
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.connect_timeout_s = connect_timeout_s
        self.who = identity("wt-barrier-store-client", who or f"pid {os.getpid()}")
        self._lock = threading.Lock()
        self._conn: tuple[socket.socket, Sealer, Opener] | None = None
        with self._lock:
            self._connect()

    def _connect(self) -> tuple[socket.socket, Sealer, Opener]:
        where = f"barrier store at {self.host}:{self.port}"
        try:
            self._conn = with_backoff(self._open, timeout_s=self.connect_timeout_s)
        except HandshakeRefused as exc:
            raise RuntimeError(f"{where} did not prove this setup's store key (another "
                               f"setup's store?): {exc}") from None
        except ConnectionError as exc:
            raise RuntimeError(f"{where}: {exc}") from None
        return self._conn

    def _open(self, left_s: float) -> tuple[socket.socket, Sealer, Opener]:
        sock = socket.create_connection((self.host, self.port),
                                        timeout=min(left_s, CONNECT_TRY_S))
        try:
            sock.settimeout(left_s)
            sealer, opener = client_handshake(
                sock, key=store_key(self.key), mode=MODE_ENCRYPT, codec=0,
                writer_id=self.who, target_id=store_identity(self.key))
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, sealer, opener

    def _call(self, op: int, items: Sequence[bytes], *, wait_s: float = 0.0) -> list[bytes]:
        with self._lock:
            sock, sealer, opener = self._conn or self._connect()
            try:
                sock.settimeout(wait_s + REPLY_MARGIN_S)
                send_message(sock, sealer, op, list(items))
                status, reply = recv_message(sock, opener)
            except (OSError, WireError, ValueError) as exc:
                self._drop_connection()
                raise RuntimeError(f"barrier store at {self.host}:{self.port}: connection "
                                   f"lost in a request: {exc!r}") from None
        if status == OK:
            return reply
        reason = reply[0].decode(errors="replace") if reply else f"status {status}"
        if status == REFUSED:
            raise ValueError(f"barrier store at {self.host}:{self.port}: {reason}")
        raise StoreTimeout(f"barrier store at {self.host}:{self.port}: {reason}")

    def _waiting(self, op: int, keys: Sequence[str],
                 timeout: datetime.timedelta | None) -> list[bytes]:
        wait_s = (timeout or self.timeout).total_seconds()
        items = [str(int(wait_s * 1000)).encode(), *map(_bytes, keys)]
        return self._call(op, items, wait_s=wait_s)

    # ------------------------------------------------------------------ the Store subset

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout

    def set(self, key: str, value: str | bytes) -> None:
        self._call(SET, [_bytes(key), _bytes(value)])

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, once all exist (StoreTimeout after the timeout)."""
        return self._waiting(GET, keys, None)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self._waiting(WAIT, keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._call(CHECK, [_bytes(k) for k in keys]) == [b"1"]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(ADD, [_bytes(key), str(int(amount)).encode()])[0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call(COMPARE_SET, [_bytes(key), _bytes(expected), _bytes(desired)])[0]

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, [_bytes(key)]) == [b"1"]

    def num_keys(self) -> int:
        return int(self._call(NUM_KEYS, [])[0])

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn[0].close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop_connection()
