"""A barrier over a torch.distributed Store that names the ranks that did not arrive.

The trainers pass it between mesh groups. It needs only a key-value store
(``TCPStore`` on the ordinary network, or any ``torch.distributed.Store``), not
a process group, so it works beside NCCL, gloo or no backend at all::

    barrier = StoreBarrier(store, rank=3, ranks=range(8), timeout_s=30)
    barrier.wait("v7/g0")                 # blocking
    await barrier.wait_async("v7/g1")     # from the pipeline's event loop

Each call site passes a tag unique to that crossing (version and group). One
crossing, in order:

1. every rank sets its arrival key ``<name>/<tag>/<rank>``;
2. every rank blocks in the store's own ``wait(keys, timeout)`` until all
   arrival keys exist (no polling: the store server wakes the waiter);
3. every rank that passed adds 1 to ``<name>/<tag>/passed``; the rank whose
   add makes it ``len(ranks)`` deletes the tag's keys. By then every rank has
   seen every arrival key, so nothing is deleted under a waiter, and the store
   holds no key of a finished crossing: it does not grow with the updates.

On timeout a :class:`~weight_transfer.errors.BarrierTimeoutError` (a
:class:`TimeoutError`) lists the missing ranks. A crossing that
timed out leaves its keys behind (its tag is never used again: versions only
grow); that is one failed update's worth of keys, not a leak per update.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Iterable
from typing import Any

from weight_transfer.errors import BarrierTimeoutError

log = logging.getLogger(__name__)


class StoreBarrier:
    """See the module docstring."""

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        ranks: Iterable[int],
        name: str = "wt-barrier",
        timeout_s: float = 60.0,
    ) -> None:
        self.ranks = tuple(sorted(set(ranks)))
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not one of the barrier's ranks {self.ranks}")
        if timeout_s <= 0:
            raise ValueError(f"barrier timeout must be positive, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.name = name
        self.timeout_s = timeout_s

    def _key(self, tag: str, rank: int | str) -> str:
        return f"{self.name}/{tag}/{rank}"

    def wait(self, tag: str) -> float:
        """Arrive and wait for every rank; returns the seconds spent waiting."""
        start = time.monotonic()
        keys = [self._key(tag, r) for r in self.ranks]
        self.store.set(self._key(tag, self.rank), b"1")
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # DistStoreError: the store's wait timed out
            waited = time.monotonic() - start
            missing = [r for r in self.ranks if not self.store.check([self._key(tag, r)])]
            if not missing:  # the last rank arrived just as the wait gave up
                log.debug("rank %d: barrier %s/%s complete after a late wake-up (%s)",
                          self.rank, self.name, tag, exc)
            else:
                raise BarrierTimeoutError(
                    f"barrier {self.name}/{tag}: ranks {missing} of {list(self.ranks)} did not "
                    f"arrive within {self.timeout_s:g} s (rank {self.rank} waited {waited:.1f} s)",
                    barrier=f"{self.name}/{tag}", missing=missing, timeout_s=self.timeout_s,
                ) from exc
        self._leave(tag, keys)
        waited = time.monotonic() - start
        log.debug("rank %d passed barrier %s/%s after %.4f s", self.rank, self.name, tag, waited)
        return waited

    def _leave(self, tag: str, keys: list[str]) -> None:
        """Count this rank out; the last rank out deletes the crossing's keys."""
        passed = self._key(tag, "passed")
        if self.store.add(passed, 1) < len(self.ranks):
            return
        for key in (*keys, passed):
            self.store.delete_key(key)

    async def wait_async(self, tag: str) -> float:
        return await asyncio.to_thread(self.wait, tag)
