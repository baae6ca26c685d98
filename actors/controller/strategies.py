"""The two ways an update reaches the engines, as strategies of the one sequence of
:class:`~actors.controller.update.UpdateSteps`, and shadow mode's rollback.

::

    strategy = strategy_for(state, calls, config, pause=True)
    steps.run(7, strategy, trace=False, auto_resync=True)
    rollback(state, calls, config, audit, in_flight=None)   # shadow mode: flip back

:class:`InPlace` (``TransferConfig.apply="in_place"``): begin pauses every running
replica (``wt_pause``, unless ``pause_during_update`` is off); end resumes every
replica that got all its bytes (``wt_resume`` with the epoch and a wall-clock
deadline; a late one is refused by the rank) or tells a running one the version
(``wt_set_version``); every other replica is torn.

:class:`Shadow` (``apply="shadow"``): every engine rank keeps a second copy of its
weights (:mod:`weight_transfer.engines.shadow.store`) that the plan writes while the
live copy serves. Begin stages the shadows (``wt_stage``; for a delta update with
``base``: each rank first copies its live memory into the shadow, the records are
based on the version served); end flips every replica that got all its bytes and
passed the check (``wt_flip``: a swap at a step boundary, the pause is the swap
alone), and every other replica discards its shadow (``wt_discard_shadow``): its
live memory was never written, it keeps serving and reporting the version it had
(``UpdateError.kept``). A replica whose flip failed on some of its ranks is torn,
as in place; one whose every rank refused the flip (:func:`none_flipped`) is not.
A failed update in shadow mode is transactional: no replica is torn by it.
:func:`rollback` flips every replica back to the version it held before its last
flip, also after the new one served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from actors.config import TransferConfig
from actors.controller.audit import AuditLog, NoAudit, RollbackAudit
from actors.controller.calls import ControlCalls
from actors.controller.engine_control import (
    RankFault,
    describe_faults,
    fan_out,
    merge_faults,
    next_epoch,
    wall_deadline,
)
from actors.controller.replicas import hold
from actors.controller.state import ControllerState
from actors.controller.update import PAUSE_SHARE, Ending, Faults, UpdateStrategy
from weight_transfer.engines.rank import EngineRank, ShadowEngineRank
from weight_transfer.errors import FaultKind

log = logging.getLogger(__name__)

FLIP_GRACE_S = 10.0  # a flip is waited for this long at least, even past the deadline
DISCARD_WAIT_S = 5.0  # how long discarding failed shadows waits for ranks that answer


class InPlace:
    """Pause, write, resume: the replicas stop serving while their weights are written
    (``pause`` False: they are not paused, only told the new version)."""

    def __init__(self, state: ControllerState, calls: ControlCalls, config: TransferConfig,
                 *, pause: bool) -> None:
        self.state, self.calls, self.config, self.pause = state, calls, config, pause

    def begin(self, version: int, names: Sequence[str], *, until: float,
              base: bool) -> Faults:
        st = self.state
        if not self.pause:
            return {}
        faults = fan_out(self.calls.ledger, st.replicas, [n for n in names if n not in st.paused],
                         EngineRank.wt_pause, self.config.update_timeout_s * PAUSE_SHARE,
                         epoch=next_epoch(), until=until)
        st.paused.update(names)
        return faults

    def end(self, version: int, names: Sequence[str], good: Sequence[str], failed: set[str],
            faults: Faults, *, deadline: float) -> Ending:
        """Resume the paused replicas of ``good``, tell the running ones the version; every
        replica that failed or did not answer is torn."""
        st, ledger = self.state, self.calls.ledger
        resume = [n for n in good if n in st.paused]
        ended = fan_out(ledger, st.replicas, resume, EngineRank.wt_resume, version,
                        epoch=next_epoch(), deadline=wall_deadline(deadline), until=deadline)
        st.paused.difference_update(n for n in resume if n not in ended)
        merge_faults(ended, fan_out(ledger, st.replicas, [n for n in good if n not in resume],
                                    EngineRank.wt_set_version, version, epoch=next_epoch(),
                                    until=deadline))
        for n in good:
            if n not in ended:
                st.versions[n] = version
        merge_faults(faults, ended)
        return Ending(torn=tuple(sorted(failed | set(faults))))


def none_flipped(faults: Sequence[RankFault], ranks: int) -> bool:
    """Every rank of a replica answered and refused its flip (stale, late, or a shadow not
    staged with the version): none swapped, its live memory is whole."""
    refused = {f.rank for f in faults if f.kind in (FaultKind.REFUSED, FaultKind.FAILED)}
    return len(refused) == ranks


class Shadow:
    """Stage, write, flip: the replicas serve their live copy while the shadow is written;
    a replica that did not get every byte discards its shadow and keeps serving."""

    def __init__(self, state: ControllerState, calls: ControlCalls,
                 config: TransferConfig) -> None:
        self.state, self.calls, self.config = state, calls, config

    def _fan(self, names: Sequence[str], method: Callable, *args: object, until: float,
             **kw: object) -> Faults:
        st = self.state
        return fan_out(self.calls.ledger, st.replicas, [n for n in names if n in st.replicas],
                       method, *args, until=until, **kw)

    def begin(self, version: int, names: Sequence[str], *, until: float,
              base: bool) -> Faults:
        for name in names:  # the shadows are overwritten: no rollback onto them any more
            self.state.previous[name] = None
        return self._fan(names, ShadowEngineRank.wt_stage, version, epoch=next_epoch(),
                         until=until, **({"base": True} if base else {}))

    def end(self, version: int, names: Sequence[str], good: Sequence[str], failed: set[str],
            faults: Faults, *, deadline: float) -> Ending:
        """Flip ``good``; a replica whose flip no rank took, and every replica of
        ``failed``, discards its shadow and keeps its version; a partial flip is torn."""
        st = self.state
        flips = self._fan(good, ShadowEngineRank.wt_flip, version, epoch=next_epoch(),
                          deadline=wall_deadline(deadline),
                          until=max(deadline, time.monotonic() + FLIP_GRACE_S))
        merge_faults(faults, flips)
        torn = sorted(n for n in flips if not none_flipped(flips[n], len(st.replicas[n])))
        for name in good:
            if name not in flips:
                st.previous[name] = st.versions.get(name)
                st.versions[name] = version
                st.paused.discard(name)
        failed = failed | {n for n in flips if n not in torn}
        discard = [n for n in names if n in failed]
        for name in discard:  # a failed transfer's shadow holds nothing to roll back onto
            st.previous[name] = None
        if discard:  # best effort, not waited for beyond DISCARD_WAIT_S
            merge_faults(faults, self._fan(discard, ShadowEngineRank.wt_discard_shadow,
                                           epoch=next_epoch(),
                                           until=time.monotonic() + DISCARD_WAIT_S))
        return Ending(torn=tuple(torn), kept={n: st.versions.get(n) for n in discard
                                              if n not in torn})


def strategy_for(state: ControllerState, calls: ControlCalls, config: TransferConfig, *,
                 pause: bool) -> UpdateStrategy:
    """The strategy of ``config.apply``: :class:`Shadow` or :class:`InPlace`."""
    if config.apply == "shadow":
        return Shadow(state, calls, config)
    return InPlace(state, calls, config, pause=pause)


def rollback(state: ControllerState, calls: ControlCalls, config: TransferConfig,
             audit: AuditLog | NoAudit, in_flight: int | None) -> dict[str, int | None]:
    """Flip every replica back to the version it held before its last flip; returns the
    versions now held. ValueError (nothing changed) in place, while a transfer is in
    flight, or when a replica has no previous version; replicas whose ranks fail the
    flip are held (torn) and named in the RuntimeError."""
    state.check_ready("rollback()")
    if config.apply != "shadow":
        raise ValueError("rollback() needs TransferConfig.apply='shadow' (in place, the "
                         "previous version is not kept)")
    if in_flight is not None:
        raise ValueError(f"rollback(): the update to version {in_flight} is in flight; a flip "
                         "now would serve a shadow being written. Wait for it to end")
    names = list(state.replicas)
    missing = {n: state.versions.get(n) for n in names if state.previous.get(n) is None}
    if missing:
        raise ValueError(f"rollback(): no previous version on replicas {sorted(missing)} "
                         "(never flipped twice, rolled back already, or their last update "
                         "failed and overwrote the shadow); nothing changed")
    started, before = time.time(), {n: state.versions.get(n) for n in names}
    target = {n: state.previous[n] for n in names}
    deadline = time.monotonic() + config.update_timeout_s
    faults = fan_out(calls.ledger, state.replicas, names, ShadowEngineRank.wt_rollback,
                     epoch=next_epoch(), deadline=wall_deadline(deadline), until=deadline)
    for name in names:
        if name not in faults:
            state.versions[name] = target[name]
            state.previous[name] = None
            state.served.drop(name)  # its checksums are the undone version's
    torn = sorted(faults)
    if torn:
        hold(state, calls, torn, faults)
    error = None if not torn else (f"rollback failed on replicas {torn}: "
                                   f"{describe_faults(faults)}; they are held (torn)")
    audit.record(RollbackAudit(started_at=started, finished_at=time.time(), before=before,
                               after=dict(state.versions), torn=tuple(torn), error=error))
    if error is not None:
        raise RuntimeError(error)
    log.info("rolled back: %s -> %s", before, dict(state.versions))
    return dict(state.versions)

