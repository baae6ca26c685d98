"""Retry of WRITEs that failed with a transient transport error, under a stated policy.

Which errors count: those the transport classes as transient,
``transport.is_transient(exc)`` (by default a
:class:`~weight_transfer.transport.base.TransientTransportError`: simnic's
:class:`~weight_transfer.transport.base.LinkDownError`, a link down; rdma's full
send queue; Mooncake's refused or reset connection). A refused write
(:class:`RemoteAccessError`: wrong rkey, out of bounds, revoked region), a dead
or unconnected peer (:class:`PeerUnreachableError`) and any other TransportError
fail at once: retrying cannot help them. A WRITE is idempotent (the same source bytes into the same
range), so writing it again after a partial delivery is safe.

How: a WRITE is tried up to ``attempts`` times; before try ``k + 1`` the rank
sleeps ``min(backoff_s * backoff_factor ** (k - 1), max_backoff_s)`` (default
4 tries, 0.05 s, 0.1 s, 0.2 s apart: a fault shorter than 0.35 s is ridden out).
When the last try fails, :class:`RetriesExhaustedError` names the writer's NIC,
the peer, the region, the tries and the last error. One WRITE at a time
probes a failing peer NIC while the others wait for its verdict; once a peer
NIC ran out of tries, the rest of the run's writes into it fail at their first
transient error (a peer that stays down costs one backoff sequence per run,
not one per WRITE)::

    policy = RetryPolicy(attempts=4, backoff_s=0.05)      # or .model_validate({...})
    writer = RetryingWriter(nic, policy)                   # one per run
    await writer.write(src, region, offset)
    writer.retries                                         # retries this run made
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import Field

from weight_transfer.config_files import StrictModel
from weight_transfer.transport.base import (
    RetriesExhaustedError,
    TransportError,
    source_buffer,
)
from weight_transfer.types import RegionDesc

log = logging.getLogger(__name__)


class RetryPolicy(StrictModel):
    """How often and how far apart a WRITE that failed transiently is tried again.

    These defaults are the library's (``TransferConfig.retry``, a trainer rank's
    ``RankOptions`` and ``RankTransfer`` take ``RetryPolicy()``); an error names the field
    (``TransferConfig.retry.attempts: ...``). Strict: ``2.5`` tries, ``True`` or ``"0.1"`` s
    are refused, as is an infinite sleep."""

    attempts: int = Field(default=4, ge=1, le=100, strict=True)  # tries in all (1: never retry)
    backoff_s: float = Field(default=0.05, ge=0, allow_inf_nan=False, strict=True)  # 2nd try
    # each later sleep this much longer
    backoff_factor: float = Field(default=2.0, ge=1, allow_inf_nan=False, strict=True)
    max_backoff_s: float = Field(default=1.0, ge=0, allow_inf_nan=False, strict=True)  # a sleep

    def delays(self) -> list[float]:
        """The sleeps before the 2nd, 3rd ... try."""
        return [min(self.backoff_s * self.backoff_factor ** k, self.max_backoff_s)
                for k in range(self.attempts - 1)]

    def describe(self) -> str:
        return (f"{self.attempts} tries, backoff {self.backoff_s:g} s x{self.backoff_factor:g} "
                f"(at most {self.max_backoff_s:g} s)")


class RetryingWriter:
    """One run's WRITEs through ``transport`` under ``policy`` (see the module docstring)."""

    def __init__(self, transport: Any, policy: RetryPolicy) -> None:
        self.transport, self.policy = transport, policy
        self.retries = 0
        self._given_up: dict[tuple[str, str], str] = {}  # peer NIC -> why
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._label = f"NIC {transport.owner}/{transport.nic}"

    async def write(self, src: Any, dst: RegionDesc, dst_offset: int) -> None:
        try:
            await self.transport.write(src, dst, dst_offset)
            return
        except TransportError as exc:
            if not self.transport.is_transient(exc):
                raise
            first = exc
        peer = (dst.owner, dst.nic)
        # One write at a time probes a failing peer NIC; the others wait for its verdict.
        async with self._locks.setdefault(peer, asyncio.Lock()):
            await self._retry(src, dst, dst_offset, first)

    async def _retry(self, src: Any, dst: RegionDesc, dst_offset: int,
                     exc: TransportError) -> None:
        peer, start = (dst.owner, dst.nic), time.monotonic()
        delays = self.policy.delays()
        for tries, delay in enumerate(delays, 2):
            if peer in self._given_up:
                break
            self.retries += 1
            log.info("%s: write into %s/%s failed (%s); try %d of %d in %.3f s", self._label,
                     dst.owner, dst.nic, exc, tries, len(delays) + 1, delay)
            await asyncio.sleep(delay)
            try:
                await self.transport.write(src, dst, dst_offset)
                return
            except TransportError as again:
                if not self.transport.is_transient(again):
                    raise
                exc = again
        else:
            raise self._exhausted(src, dst, dst_offset, len(delays) + 1, start, exc,
                                  None) from exc
        raise self._exhausted(src, dst, dst_offset, 0, start, exc, self._given_up[peer]) from exc

    def _exhausted(self, src: Any, dst: RegionDesc, dst_offset: int, tries: int, start: float,
                   exc: Exception, earlier: str | None) -> RetriesExhaustedError:
        nbytes = source_buffer(src).nbytes
        what = (f"{self._label}: write of {nbytes} B at offset {dst_offset} into peer "
                f"{dst.owner}/{dst.nic} ({dst.describe()})")
        if earlier is not None:
            return RetriesExhaustedError(f"{what} failed: {type(exc).__name__}: {exc} "
                                         f"(not retried: {earlier})")
        why = (f"failed {tries} tries over {time.monotonic() - start:.2f} s "
               f"(retry policy: {self.policy.describe()}); last error "
               f"{type(exc).__name__}: {exc}")
        self._given_up[(dst.owner, dst.nic)] = "retries on this peer NIC ran out earlier " \
                                               "in this update"
        return RetriesExhaustedError(f"{what} {why}")
