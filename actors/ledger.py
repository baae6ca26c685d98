"""Counts what the controller sends through Ray: every call's arguments and results.

The controller issues every actor call through a :class:`ControlLedger`, which
adds the pickled size of the arguments when the call leaves and of the result
when it is fetched. The difference of two snapshots is what one phase (one
update, say) put into Ray's object store; weights never pass through it, so
this stays a few kilobytes whatever the model::

    ledger = ControlLedger()
    before = ledger.snapshot()
    ref = ledger.call(actor.wt_update, 7)
    report = ledger.get(ref, timeout=60)
    nbytes, calls = ledger.since(before)
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import ray


def pickled_size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class ControlLedger:
    """See the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.calls = 0

    def _add(self, nbytes: int, calls: int = 0) -> None:
        with self._lock:
            self.bytes += nbytes
            self.calls += calls

    def call(self, method: Any, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """``method.remote(*args, **kwargs)``, counting the arguments' bytes."""
        self._add(pickled_size((args, kwargs)), calls=1)
        return method.remote(*args, **kwargs)

    def record_result(self, value: Any) -> Any:
        self._add(pickled_size(value))
        return value

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        """``ray.get`` counting the results' bytes."""
        return self.record_result(ray.get(refs, timeout=timeout))

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.bytes, self.calls

    def since(self, snap: tuple[int, int]) -> tuple[int, int]:
        nbytes, calls = self.snapshot()
        return nbytes - snap[0], calls - snap[1]
