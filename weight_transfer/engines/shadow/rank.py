"""The engine-rank side of shadow mode: stage, flip, rollback and discard, fenced by epochs.

One :class:`ShadowControl` per engine rank (the reference engine's actor; any
engine whose adapter can give a second copy of its buffers). It owns the rank's
:class:`~weight_transfer.engines.shadow.store.ShadowCopy` and runs every command under
the rank's :class:`~weight_transfer.engines.fence.CommandFence`, so a stale
command is ignored exactly as a stale pause or resume is::

    ctl = ShadowControl(owner, "reference", fence=fence, mem=mem, boundary=adapter)
    info = ctl.setup(adapter.region_buffers(), adapter.shadow_buffers())  # before register
    ctl.stage(8, epoch)                     # writes may land in the shadow from now on
    ctl.stage(8, epoch, base=True)          # delta update: copy live into the shadow first
    ctl.flip(8, epoch, deadline)            # at a step boundary: swap, reset caches, serve 8
    ctl.rollback(epoch, deadline)           # one more swap: the previous version serves
    ctl.discard(epoch)                      # a failed transfer: live memory untouched

The flip waits for a step boundary through the adapter's pause point
(``boundary.pause()``, ``wait_idle(timeout)``, ``resume()``; on a TP replica the
ranks agree on the step they park at, so every rank of a replica computes the
same step with the same version), flushes GPUDirect RDMA writes on a GPU
(:func:`~weight_transfer.engines.gpu_flush.flush_gpudirect_writes`), swaps, resets
the engine's caches (``boundary.reset_cache()`` where it has one) and lets
generation go on: the stall is the swap alone. On a TP replica the ranks first meet
(``boundary.rendezvous(key, timeout_s)`` where the adapter has one, e.g.
:func:`store_rendezvous` over the replica's store): the flip commands reach the
ranks at different times, and the first rank to park parks its peers too (the
agreed step), which would then wait for their own command. Meeting first, every
rank holds its command before any parks: the replica waits for the swap, not
for the slowest command's delivery. A peer that never comes (a refused flip, a
dead rank) is waited for :data:`RENDEZVOUS_S` at most, then the rank flips as
without it. The NICs' update window
(``tcp``) is open from the stage to the flip or the discard.

A sparse delta update stages with ``base=True``: the shadow first receives a copy
of live memory (the version served, which the delta records name as their base;
memory bandwidth, off the pause: generation goes on, it only reads live memory,
and nothing else writes it until a flip, which waits for this command's lock);
:meth:`ShadowControl.delta_target` then gives the delta apply the shadow's base.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from weight_transfer.engines.fence import CommandFence
from weight_transfer.engines.gpu_flush import flush_gpudirect_writes
from weight_transfer.engines.registered import RegisteredMemory
from weight_transfer.engines.shadow.store import ShadowCopy, ShadowError, ShadowInfo

log = logging.getLogger(__name__)

R = TypeVar("R")
FLIP_WAIT_S = 60.0  # the longest a flip waits for the step that runs to end
RENDEZVOUS_S = 2.0  # the longest a flip waits for its TP peers' commands before parking


def _key(what: str, epoch: int | None) -> str | None:
    """The rendezvous key of a command: every rank of a replica gets the same epoch."""
    return None if epoch is None else f"{what}/{epoch}"


def store_rendezvous(store: Any, ranks: int, *, prefix: str) -> Callable[[str, float], bool]:
    """``meet(key, timeout_s)`` for the ``ranks`` ranks of one replica over a torch
    ``Store`` they share: True once every rank called it with ``key``, False after
    ``timeout_s`` (the last to arrive releases the others)."""
    import datetime

    def meet(key: str, timeout_s: float) -> bool:
        name = f"{prefix}/{key}"
        if store.add(name, 1) >= ranks:
            store.set(f"{name}/go", b"1")
            return True
        try:
            store.wait([f"{name}/go"], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # torch raises its DistStoreError (a RuntimeError) or others
            log.warning("%s: not every TP rank came to the flip within %.1f s (%s); flipping "
                        "as without a rendezvous", name, timeout_s, exc)
            return False
        return True

    return meet


class ShadowControl:
    """See the module docstring."""

    def __init__(self, owner: str, engine: str, *, fence: CommandFence,
                 mem: RegisteredMemory, boundary: Any) -> None:
        self.owner, self.engine = owner, engine
        self.fence, self.mem, self.boundary = fence, mem, boundary
        self.copy: ShadowCopy | None = None
        self.last_stall_s = 0.0  # the engine's pause of the last flip or rollback
        self.last_sync_s = 0.0  # the last copy of live into the shadow (not a pause)

    @property
    def enabled(self) -> bool:
        return self.copy is not None

    def require(self) -> ShadowCopy:
        if self.copy is None:
            raise ShadowError(f"{self.owner}: shadow mode is not set up on this {self.engine} "
                              "engine rank (wt_shadow_setup() first)")
        return self.copy

    def setup(self, live: list, shadow: list) -> ShadowInfo:
        """Pair ``live`` and ``shadow`` buffers (same layout); idempotent."""
        if self.copy is None:
            self.copy = ShadowCopy(self.owner, self.engine, live=live, shadow=shadow)
            log.info("%s: shadow of %d B (+%d B scratch) on %s", self.owner, self.copy.nbytes,
                     self.copy.scratch.numel(), self.copy.device)
        return self.info()

    def bind(self) -> None:
        """After the shadow was registered: region address -> live bytes."""
        self.require().bind(list(self.mem.buffers))

    def info(self) -> ShadowInfo:
        return self.require().info(self.fence.version, self.last_stall_s, self.last_sync_s)

    def stage(self, version: Any, epoch: int | None, base: bool = False) -> bool:
        """The shadow receives ``version`` from now on; ``base``: copy live into it first
        (a delta update: its records name the version served as their base)."""
        copy = self.require()

        def run() -> None:
            held = self.fence.version if base else None
            copy.state.stage(version, base=held)  # the shadow's old content is dropped
            if base:
                start = time.perf_counter()
                nbytes = copy.sync()
                self.last_sync_s = time.perf_counter() - start
                log.info("%s: shadow brought to live version %s for a delta (%d B in %.4f s, "
                         "serving meanwhile)", self.owner, held, nbytes, self.last_sync_s)
            self.mem.open_window()  # tcp: the plan's writes are accepted until flip/discard

        return self.fence.fenced("stage", epoch, run)

    def apply_delta(self, version: Any, apply: Callable[[Any, dict], R]) -> R:
        """The delta apply of ``version`` into the shadow, under the command lock (no flip
        meanwhile): ``apply(base, buffers)`` with the base version the shadow holds (None:
        none, every record is refused and re-sent dense) and the registered shadow
        buffers (never live memory). ShadowError unless staged with ``version``."""
        copy = self.require()
        return self.fence.locked(lambda: apply(copy.state.delta_base(version),
                                               dict(self.mem.buffers)))

    def discard(self, epoch: int | None) -> bool:
        copy = self.require()

        def run() -> None:
            if copy.state.discard():
                self.mem.close_window()

        return self.fence.fenced("discard", epoch, run)

    def flip(self, version: Any, epoch: int | None, deadline: float | None,
             timeout_s: float = FLIP_WAIT_S) -> bool:
        copy = self.require()

        def run(live: Any) -> Any:
            copy.state.check_flip(version)  # refused before the engine is paused
            self.mem.close_window()  # no write lands once the shadow serves
            self._swap_at_boundary(timeout_s, serve=version, key=_key("flip", epoch))
            copy.state.flip(version, live=live)
            return version

        return self.fence.swap("flip", epoch, deadline, run)

    def rollback(self, epoch: int | None, deadline: float | None,
                 timeout_s: float = FLIP_WAIT_S) -> bool:
        copy = self.require()

        def run(live: Any) -> Any:
            back = copy.state.check_rollback()
            self._swap_at_boundary(timeout_s, serve=back, key=_key("rollback", epoch))
            return copy.state.rollback(live=live)

        return self.fence.swap("rollback", epoch, deadline, run)

    def _swap_at_boundary(self, timeout_s: float, serve: Any, key: str | None) -> None:
        """The swap at a step boundary; the steps after it are tagged ``serve``. ``key``
        names the command for the TP rendezvous (module docstring; None: a command with
        no epoch, which its peers cannot name alike: no rendezvous)."""
        copy, b = self.require(), self.boundary
        meet = getattr(b, "rendezvous", None)
        if meet is not None and key is not None:
            meet(key, min(timeout_s, RENDEZVOUS_S))
        b.pause()
        try:
            if not b.wait_idle(timeout_s):
                raise TimeoutError(f"{self.owner}: a generation step still runs {timeout_s:g} s "
                                   "after the flip asked for a step boundary")
            start = time.perf_counter()  # at the boundary: from here the engine waits
            flush_gpudirect_writes(copy.device)  # GPU: RDMA writes visible before kernels read
            copy.swap()
            self.fence.served = serve  # version-tagged outputs: the steps from here on
            reset = getattr(b, "reset_cache", None)
            if reset is not None:
                reset()
            self.last_stall_s = time.perf_counter() - start
        finally:
            b.resume()

    def live_checksum(self, ranges: np.ndarray) -> np.ndarray:
        copy = self.require()
        return self.mem.checksum(ranges, buffers=copy.live_by_region)

    def source_addr(self, region_addr: int) -> int:
        """For a peer copy: the live bytes behind a registered (shadow) region."""
        return self.require().live_addr(region_addr)
