"""A barrier over a torch.distributed Store whose arrivals are authenticated and checked.

The trainers pass it between mesh groups. It needs only a key-value store
(``TCPStore`` on the ordinary network, or any ``torch.distributed.Store``), not
a process group, so it works beside NCCL, gloo or no backend at all::

    key = BarrierKey.new()                # the controller, once per setup; sent over Ray
    barrier = StoreBarrier(store, rank=3, ranks=range(8), key=key, timeout_s=30)
    barrier.wait("v7/g0")                 # blocking
    await barrier.wait_async("v7/g1")     # from the pipeline's event loop

A store's port answers anyone who reaches it (a ``TCPStore`` has no
authentication: any client may list, set and delete keys). So nothing in the
store is trusted: every arrival value is an HMAC-SHA256, under the setup's
secret, of (setup id, barrier name, tag, rank), and every rank checks every
arrival before it passes. The barrier name is random per setup, so tags like
``v7/g0`` are not guessable keys. What an outsider on the port can still do is
make a crossing *fail* (named below); it cannot make one *pass*.

One crossing, in order:

1. every rank writes its arrival ``<name>/<tag>/<rank>`` = its MAC with
   ``compare_set`` (only if the key is absent): a value already there is a
   pre-arrival nobody of this setup made -> ``BarrierRefusedError`` (``pre-arrived``);
2. every rank blocks in the store's own ``wait(keys, timeout)`` until all
   arrival keys exist (no polling: the store server wakes the waiter);
3. every rank reads every arrival and checks its MAC: a value that is not the
   MAC of that rank at that tag (set by someone without the secret, to release
   the barrier early, or a value copied from another tag or rank) ->
   ``BarrierRefusedError`` (``forged``) naming the rank; an arrival that existed
   and is gone -> ``BarrierRefusedError`` (``deleted``);
4. every rank that passed adds 1 to ``<name>/<tag>/passed``; the rank whose
   add makes it ``len(ranks)`` deletes the tag's keys. By then every rank has
   checked every arrival, so nothing is deleted under a checker, and the store
   holds no key of a finished crossing: it does not grow with the updates.

On timeout a :class:`~weight_transfer.errors.BarrierTimeoutError` (a
:class:`TimeoutError`) lists the missing ranks; a rank that finds its *own*
arrival gone raises ``BarrierRefusedError`` (``deleted``) instead, so a deleted
key is not blamed on the rank that did arrive. A crossing that failed leaves
its keys behind (its tag is never used again: versions only grow; a new setup
uses a new store and a new name).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from weight_transfer.errors import BarrierRefusedError, BarrierTimeoutError

log = logging.getLogger(__name__)

VERIFY_S = 10.0  # reading the arrivals back, first try (they exist: the wait saw them)


@dataclass(frozen=True, slots=True, kw_only=True)
class BarrierKey:
    """One setup's barrier identity: a random ``setup_id`` and ``name``, and the secret
    that authenticates arrivals. Made by the controller at each setup, handed to the
    ranks over the control plane (Ray, which authenticates); never put in the store."""

    setup_id: str
    name: str
    secret: bytes = field(repr=False)

    @classmethod
    def new(cls, prefix: str = "wt-update") -> BarrierKey:
        setup_id = secrets.token_hex(8)
        return cls(setup_id=setup_id, name=f"{prefix}-{secrets.token_hex(8)}",
                   secret=secrets.token_bytes(32))

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError(f"barrier {self.name}: the secret must be at least 16 bytes, "
                             f"got {len(self.secret)}")

    def mac(self, tag: str, rank: int) -> bytes:
        """The arrival value of ``rank`` at ``tag`` (hex of an HMAC-SHA256)."""
        msg = f"{self.setup_id}\0{self.name}\0{tag}\0{int(rank)}".encode()
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest().encode()


class StoreBarrier:
    """See the module docstring."""

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        ranks: Iterable[int],
        key: BarrierKey,
        timeout_s: float = 60.0,
    ) -> None:
        self.ranks = tuple(sorted(set(ranks)))
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not one of the barrier's ranks {self.ranks}")
        if timeout_s <= 0:
            raise ValueError(f"barrier timeout must be positive, got {timeout_s}")
        if not isinstance(key, BarrierKey):
            raise ValueError(f"a barrier needs this setup's BarrierKey, not {type(key).__name__}")
        self.store = store
        self._store_timeout = store.timeout
        self.rank = rank
        self.key = key
        self.name = key.name
        self.timeout_s = timeout_s

    def _key(self, tag: str, rank: int | str) -> str:
        return f"{self.name}/{tag}/{rank}"

    def _refuse(self, tag: str, rank: int, reason: str, what: str) -> BarrierRefusedError:
        msg = (f"barrier {self.name}/{tag}: {reason} arrival of rank {rank} refused by rank "
               f"{self.rank}: {what}")
        log.warning("%s", msg)
        return BarrierRefusedError(msg, barrier=f"{self.name}/{tag}", rank=rank, tag=tag,
                                   reason=reason)

    def wait(self, tag: str) -> float:
        """Arrive, wait for every rank, check every arrival; returns the seconds spent."""
        start = time.monotonic()
        keys = [self._key(tag, r) for r in self.ranks]
        mine = self.key.mac(tag, self.rank)
        if self.store.compare_set(self._key(tag, self.rank), "", mine) != mine:
            raise self._refuse(tag, self.rank, "pre-arrived", "a value was already set for "
                               "it before it arrived, by someone without this setup's secret")
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # DistStoreError: the store's wait timed out
            self._timed_out(tag, start, exc)
        self._check_arrivals(tag, keys)
        self._leave(tag, keys)
        waited = time.monotonic() - start
        log.debug("rank %d passed barrier %s/%s after %.4f s", self.rank, self.name, tag, waited)
        return waited

    def _timed_out(self, tag: str, start: float, exc: Exception) -> None:
        waited = time.monotonic() - start
        missing = [r for r in self.ranks if not self.store.check([self._key(tag, r)])]
        if self.rank in missing:
            raise self._refuse(tag, self.rank, "deleted", "its arrival key was removed from "
                               "the store while it waited") from exc
        if not missing:  # the last rank arrived just as the wait gave up
            log.debug("rank %d: barrier %s/%s complete after a late wake-up (%s)",
                      self.rank, self.name, tag, exc)
            return
        raise BarrierTimeoutError(
            f"barrier {self.name}/{tag}: ranks {missing} of {list(self.ranks)} did not "
            f"arrive within {self.timeout_s:g} s (rank {self.rank} waited {waited:.1f} s)",
            barrier=f"{self.name}/{tag}", missing=missing, timeout_s=self.timeout_s,
        ) from exc

    def _check_arrivals(self, tag: str, keys: list[str]) -> None:
        """Every arrival is still there and is the MAC of its rank at this tag."""
        values = self._read_arrivals(tag, keys)
        for r, value in zip(self.ranks, values, strict=True):
            if not hmac.compare_digest(bytes(value), self.key.mac(tag, r)):
                raise self._refuse(tag, r, "forged", "its value is not this setup's MAC for "
                                   "that rank and tag (set by someone without the secret)")

    def _read_arrivals(self, tag: str, keys: list[str]) -> list[bytes]:
        """One round trip when nothing is wrong. A key deleted since the wait makes the get
        block: a shorter timeout turns that into a named refusal, not a long hang (a get
        that was only slow, every key still there, is tried again with the full timeout)."""
        self.store.set_timeout(datetime.timedelta(seconds=min(self.timeout_s, VERIFY_S)))
        try:
            return self.store.multi_get(keys)
        except RuntimeError as exc:  # DistStoreError: a key vanished since the wait?
            gone = self._gone(keys)
            if gone >= 0:
                raise self._refuse(tag, gone, "deleted", "its arrival key was removed from "
                                   "the store before every rank had checked it") from exc
        finally:
            self.store.set_timeout(self._store_timeout)
        return self.store.multi_get(keys)

    def _gone(self, keys: list[str]) -> int:
        """The first rank whose arrival key is absent (-1: none is, any more)."""
        return next((r for r, k in zip(self.ranks, keys, strict=True)
                     if not self.store.check([k])), -1)

    def _leave(self, tag: str, keys: list[str]) -> None:
        """Count this rank out; the last rank out deletes the crossing's keys."""
        passed = self._key(tag, "passed")
        if self.store.add(passed, 1) < len(self.ranks):
            return
        for key in (*keys, passed):
            self.store.delete_key(key)

    async def wait_async(self, tag: str) -> float:
        return await asyncio.to_thread(self.wait, tag)
