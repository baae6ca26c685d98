"""Pure helpers of the Mooncake transport: install check, chunking, deadlines, a call thread.

Kept apart from :mod:`weight_transfer.transport.mooncake.transport` so the transport class
reads as the data path; everything here runs without Mooncake installed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

UNAUTHENTICATED_RISK = (
    "Mooncake's TCP protocol authenticates nothing: its handshake port gives the registered "
    "buffers' addresses and lengths to anyone who asks, and anyone who reaches its data port "
    "reads and writes registered engine memory (only bounds are checked)"
)
_WARNED: set[tuple[Any, Any]] = set()


def tcp_across_hosts_allowed(options: Any, src: Any, dst: Any) -> bool:
    """Whether the options let an unauthenticated TCP link cross from host ``src`` to
    ``dst``: only with ``allow_unauthenticated: true``, and then with a warning (once per
    pair of hosts in this process) that names the risk. Other protocols: yes."""
    if getattr(options, "protocol", "tcp") != "tcp":
        return True
    if not getattr(options, "allow_unauthenticated", False):
        return False
    if (src, dst) not in _WARNED:
        _WARNED.add((src, dst))
        log.warning("mooncake: transport_options.allow_unauthenticated is true, so TCP links "
                    "cross hosts (%s -> %s): %s. Use it only on a network nobody else "
                    "reaches; the authenticated 'tcp' transport or 'rdma' on an isolated "
                    "fabric protect this link", src, dst, UNAUTHENTICATED_RISK)
    return True


INSTALL_HINT = (
    "install the `mooncake` extra: pip install 'weight-transfer[mooncake]' (its wheel "
    "also needs libibverbs1, librdmacm1, libnuma1, liburing2 and libcurl4; see scripts/setup.sh)"
)


def load_engine_class() -> type:
    """Mooncake's ``TransferEngine`` class, or a RuntimeError saying how to install it."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines flood stderr
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:
        raise RuntimeError(f"Mooncake TransferEngine unavailable ({exc}); {INSTALL_HINT}") from exc
    return TransferEngine


def split_chunks(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of at most ``chunk_bytes`` covering ``[0, nbytes)``."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return [(off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]


def chunk_deadline_s(nbytes: int, timeout_s: float, min_gbps: float) -> float:
    """Seconds a chunk may take: a fixed allowance plus its bytes at the slowest rate."""
    return timeout_s + nbytes / (min_gbps * 1e9)


def parse_session_id(session_id: Any, where: str) -> str:
    """Check a ``"host:port"`` session id; ValueError naming ``where`` otherwise."""
    host, sep, port = str(session_id).rpartition(":")
    if not isinstance(session_id, str) or not sep or not host or not port.isdigit():
        raise ValueError(f"{where}: session_id must be 'host:port', got {session_id!r}")
    return session_id


class CallThread:
    """One daemon thread for engine calls that may block on a stalled peer.

    Not an executor: a call stuck in Mooncake must not keep the interpreter
    from exiting.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0  # calls queued or running
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending += 1
        self._queue.put((fn, args, fut))
        return fut

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args, fut = item
            result, error = None, None
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:
                    error = exc
            with self._lock:  # before waking the caller, so that it sees us idle
                self._pending -= 1
            if fut.cancelled():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)


def _new_rkey(live: set[int]) -> int:
    """A random nonzero 32-bit key that no live region uses."""
    while (key := secrets.randbits(32)) == 0 or key in live:
        pass
    return key


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first leaf of the exception group a TaskGroup of chunks raised."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
