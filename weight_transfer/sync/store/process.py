"""The barrier store in a process of its own, owned by a handle that stops it.

::

    with BarrierStore(host=node_ip(), key=barrier_key) as store:   # the controller, per setup
        store.port                                   # with store.host, sent to the trainers
        client = store.client()                      # a StoreClient (num_keys, ...)

The child runs ``python -m weight_transfer.sync.store.server``: it gets its
settings on stdin (the store key derived from the barrier secret, never the
secret itself, and never on its command line), answers its port on stdout, and
serves until its stdin closes: when :meth:`BarrierStore.close` closes it, or when
this process dies. Whatever an outsider sends to the store's port, it lands in
that child (within the store's caps), never in the controller.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

from weight_transfer.sync.barrier import BarrierKey
from weight_transfer.sync.listen import check_listen_address
from weight_transfer.sync.store.client import StoreClient
from weight_transfer.sync.store.protocol import (
    MAX_STORE_BYTES,
    namespace,
    store_identity,
    store_key,
)

START_TIMEOUT_S = 60.0
_ROOT = str(Path(__file__).resolve().parents[3])  # the folder that holds weight_transfer/


def _stop(proc: subprocess.Popen) -> None:
    """Close the child's stdin (it stops serving and exits); kill it if it does not."""
    try:
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        proc.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


class BarrierStore:
    """See the module docstring. ``max_bytes`` caps what the store holds (keys, values and
    a fixed cost per key); a connection must prove the key within ``handshake_timeout_s``
    and at most ``max_pending`` wait at once."""

    def __init__(self, *, host: str, key: BarrierKey, max_bytes: int = MAX_STORE_BYTES,
                 handshake_timeout_s: float = 2.0, max_pending: int = 64,
                 timeout_s: float = 300.0) -> None:
        check_listen_address(host, what="barrier store")
        self.host, self.key, self.timeout_s = host, key, timeout_s
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "weight_transfer.sync.store.server"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._finalizer = weakref.finalize(self, _stop, self._proc)
        settings = {"host": host, "link_key": store_key(key).hex(),
                    "namespace": namespace(key), "target_id": store_identity(key).hex(),
                    "max_bytes": max_bytes, "handshake_timeout_s": handshake_timeout_s,
                    "max_pending": max_pending}
        try:
            self._proc.stdin.write(json.dumps(settings) + "\n")
            self._proc.stdin.flush()
            self.port = self._read_port()
        except BaseException:
            self.close()
            raise
        self._client: StoreClient | None = None

    def _read_port(self) -> int:
        ready, _, _ = select.select([self._proc.stdout], [], [], START_TIMEOUT_S)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"barrier store process (pid {self._proc.pid}) did not start "
                               f"listening on {self.host} within {START_TIMEOUT_S:g} s (exit "
                               f"status {self._proc.poll()}; its error is on stderr)")
        return int(json.loads(line)["port"])

    @property
    def pid(self) -> int:
        return self._proc.pid

    def client(self, who: str = "controller") -> StoreClient:
        """A new client of this store (it holds the key)."""
        return StoreClient(self.host, self.port, key=self.key, timeout_s=self.timeout_s, who=who)

    def num_keys(self) -> int:
        """How many keys the store holds (through a client of this handle's own)."""
        if self._client is None:
            self._client = self.client()
        return self._client.num_keys()

    def close(self) -> None:
        """Stop the store's process; idempotent."""
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            client.close()
        self._finalizer()

    def __enter__(self) -> BarrierStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
