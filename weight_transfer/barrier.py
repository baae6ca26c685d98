"""A barrier over a torch.distributed Store that names the ranks that did not arrive.

The trainers pass it between mesh groups. It needs only a key-value store
(``TCPStore`` on the ordinary network, or any ``torch.distributed.Store``), not
a process group, so it works beside NCCL, gloo or no backend at all::

    barrier = StoreBarrier(store, rank=3, ranks=range(8), timeout_s=30)
    barrier.wait("v7/g0")                 # blocking
    await barrier.wait_async("v7/g1")     # from the pipeline's event loop

Each call site passes a tag unique to that crossing (version and group): a key
per rank is set under the tag and every rank polls until all keys exist. On
timeout a :class:`TimeoutError` lists the missing ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

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
        poll_s: float = 0.002,
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
        self.poll_s = poll_s

    def _key(self, tag: str, rank: int) -> str:
        return f"{self.name}/{tag}/{rank}"

    def wait(self, tag: str) -> float:
        """Arrive and wait for every rank; returns the seconds spent waiting."""
        start = time.monotonic()
        self.store.set(self._key(tag, self.rank), b"1")
        keys = [self._key(tag, r) for r in self.ranks]
        delay = self.poll_s / 4
        while not self.store.check(keys):
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                missing = [r for r in self.ranks if not self.store.check([self._key(tag, r)])]
                raise TimeoutError(
                    f"barrier {self.name}/{tag}: ranks {missing} of {list(self.ranks)} did not "
                    f"arrive within {self.timeout_s:g} s (rank {self.rank} waited {waited:.1f} s)"
                )
            time.sleep(delay)
            delay = min(delay * 2, self.poll_s)
        waited = time.monotonic() - start
        log.debug("rank %d passed barrier %s/%s after %.4f s", self.rank, self.name, tag, waited)
        return waited

    async def wait_async(self, tag: str) -> float:
        return await asyncio.to_thread(self.wait, tag)
