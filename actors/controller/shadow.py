"""Shadow mode in the controller: set-up, an update that never stops serving, rollback.

With ``TransferConfig.apply="shadow"`` every engine rank keeps a second copy of
its weights (:mod:`weight_transfer.engines.shadow.store`); the plan writes that copy
and the engines serve their live memory throughout. An update
(:meth:`ShadowSteps.run`), under one deadline as in place:

1. stage: every rank of every replica hears that the shadow now receives the
   version (``wt_stage``, epoch-fenced; no pause);
2. "go" to every trainer, as in place;
3. the completion fence (:mod:`actors.controller.checks`): a replica goes on
   only when every WRITE into it completed at its writer and the controller
   holds the report;
4. the integrity check of the shadow's written ranges, as in place;
5. flip every replica that passed (``wt_flip``: a swap at a step boundary;
   the pause is the swap alone); every other replica discards its shadow
   (``wt_discard_shadow``): its live memory was never written, it keeps
   serving and reporting the version it had. A replica whose flip failed on
   some of its ranks is torn (held, re-synced) as in place.

With sparse deltas (``TransferConfig.delta``) the chain
(:class:`~actors.controller.delta.DeltaChain`) decides anchor or delta before step
1. A delta update stages with ``base=True``: each rank first copies its live
memory into the shadow (after a flip the shadow holds the version before; the
records are based on the one served), serving meanwhile. After step 3 every
replica that got all its writes applies the records to its shadow and the
trainers re-send dense what it could not apply (stale base, digest, unreadable
slot); then steps 4 and 5. A dense anchor is the ordinary shadow update. When a
trainer failed, a delta update flips no replica (its records cannot be
repaired); any failure makes the next update an anchor.

So a transfer that fails, times out or fails its check is transactional: no
replica is torn by it. ``rollback`` flips every replica back to the version it
held before its last flip (:func:`rollback`), also after the new one served.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from ray.exceptions import RayError

from actors.controller.audit import RollbackAudit
from actors.controller.calls import ControlCalls
from actors.controller.checks import completion_fence, verify_update
from actors.controller.engine_control import (
    RankFault,
    describe_faults,
    fan_out,
    next_epoch,
    wall_deadline,
)
from actors.controller.outcome import (
    RESUME_SHARE,
    UpdateOutcome,
    check_faults,
    merge_faults,
    refusals_of,
)
from actors.controller.replicas import hold
from actors.controller.state import ControllerState
from actors.controller.telemetry import UpdateClock, record_failure
from weight_transfer.engines.rank import ShadowEngineRank
from weight_transfer.errors import FaultKind

log = logging.getLogger(__name__)

DISCARD_WAIT_S = 5.0  # how long discarding failed shadows waits for ranks that answer


def none_flipped(faults: Sequence[RankFault], ranks: int) -> bool:
    """Every rank of a replica answered and refused its flip (stale, late, or a shadow not
    staged with the version): none swapped, its live memory is whole."""
    refused = {f.rank for f in faults if f.kind in (FaultKind.REFUSED, FaultKind.FAILED)}
    return len(refused) == ranks


def apply_delta(chain: Any, version: int, names: Sequence[str], failed: set[str], errors: bool,
                faults: dict[str, list[RankFault]]) -> set[str]:
    """Sparse deltas in shadow mode: every replica of ``names`` not ``failed`` applies the
    records of ``version`` to its shadow (``chain``: the
    :class:`~actors.controller.delta.DeltaChain`); the trainers re-send dense what it could
    not apply. The replicas that must not flip: every one of them when a trainer failed
    (``errors``) in a delta update (no repair) or when the apply or the repair failed
    (their faults added to ``faults``)."""
    todo = [n for n in names if n not in failed]
    if errors:  # an anchor's complete replicas hold whole pieces; a delta's do not
        why = None if chain.anchor else "a trainer failed: its records cannot be repaired"
    elif not todo:
        why = None
    else:
        try:
            chain.after(version, todo)
            why = None
        except (RayError, TimeoutError, RuntimeError) as err:
            why = f"applying the delta records to the shadow failed: {err}"
    if why is None:
        return set()
    log.warning("delta version %d: replicas %s do not flip: %s", version, todo, why)
    for name in todo:
        faults.setdefault(name, []).append(RankFault(
            replica=name, rank=-1, kind=FaultKind.FAILED, method="delta apply", error=why))
    return set(todo)


def _fan(ledger: Any, st: ControllerState, names: Sequence[str], method: Any, *args: Any,
         until: float, **kw: Any) -> dict[str, list[RankFault]]:
    return fan_out(ledger, st.replicas, [n for n in names if n in st.replicas], method, *args,
                   until=until, **kw)


class ShadowSteps:
    """One update in shadow mode over the in-place steps' helpers (module docstring)."""

    def __init__(self, steps: Any) -> None:
        self.steps = steps  # actors.controller.update.UpdateSteps: state, calls, config ...

    def run(self, version: int, *, trace: bool | str | os.PathLike, auto_resync: bool,
            after_transfer: Any = None) -> Any:
        s = self.steps
        st, ledger, cfg = s.state, s.calls.ledger, s.config
        offset, snap, start = UpdateClock.wall_offset(), ledger.snapshot(), time.perf_counter()
        deadline = time.monotonic() + cfg.update_timeout_s
        names = list(st.replicas)
        for name in names:  # the shadows are overwritten: no rollback onto them any more
            st.previous[name] = None
        delta = s.delta
        if delta is not None:
            delta.before(version)  # anchor or delta (actors.controller.delta)
        base = {"base": True} if delta is not None and not delta.anchor else {}
        faults = _fan(ledger, st, names, ShadowEngineRank.wt_stage, version, epoch=next_epoch(),
                      until=deadline - cfg.update_timeout_s * 0.75, **base)
        staged_at = time.perf_counter()
        reports, errors = s._run_trainers(version, trace,
                                          deadline - cfg.update_timeout_s * RESUME_SHARE)
        transfer_done = time.perf_counter()
        if after_transfer is not None:
            after_transfer(version)
        fence = completion_fence(st.summary.dest_bytes_by_rank, reports, replicas=names)
        failed = set(faults) | set(fence.pending)
        if delta is not None:
            failed |= apply_delta(delta, version, names, failed, bool(errors), faults)
        check = verify_update(
            policy=cfg.integrity, reports=list(reports.values()),
            replicas={n: st.replicas[n] for n in names if n not in failed},
            metas=st.engine_metas, call=s.calls.call, get=ledger.get,
            timeout_s=max(0.0, deadline - cfg.update_timeout_s * RESUME_SHARE
                          - time.monotonic()))
        failed |= set(check.torn)
        merge_faults(faults, check_faults(check))  # ranks that did not answer the check
        good = [n for n in names if n not in failed]
        sums = {} if s.served is None else s.served.reference(
            version, good, list(reports.values()), timeout_s=max(0.0, deadline - time.monotonic()))
        torn = self._flip(version, good, deadline, faults)
        failed |= {n for n in good if n in faults and n not in torn}  # no rank flipped
        merge_faults(faults, self._discard([n for n in names if n in failed]))
        if s.served is not None:
            s.served.commit(version, sums)
        done = UpdateOutcome(version=version, replicas=tuple(names),
                             reports=tuple(reports.values()), integrity=check,
                             refusals=refusals_of(version, errors))
        if errors or failed or torn:
            if delta is not None:
                delta.failed()  # the next update is a dense anchor
            kept = {n: st.versions.get(n) for n in names if n in failed and n not in torn}
            merge_faults(faults, hold(st, s.calls, torn, faults))
            record_failure(s.metrics, errors, reports, torn, st.versions)
            err = s._fail(version, reports, errors, faults, torn, check, auto_resync)
            kept = {n: v for n, v in kept.items() if n not in err.lost}
            err.kept = kept  # replica -> the complete version it still serves
            if kept:
                fenced = "".join(f" {n}: {why}." for n, why in sorted(fence.pending.items()))
                err.args = (f"{err.args[0]} Shadow mode: replicas {sorted(kept)} were not "
                            f"touched and keep serving versions "
                            f"{[kept[n] for n in sorted(kept)]}.{fenced}",)
            return dataclasses.replace(done, error=err)
        clock = UpdateClock(start=start, paused=staged_at, transferred=transfer_done,
                            end=time.perf_counter(), offset=offset)
        report = s.succeeded(version, clock, reports, names, ledger.since(snap), check, trace)
        return dataclasses.replace(done, report=report)

    def _flip(self, version: int, good: list[str], deadline: float,
              faults: dict[str, list[RankFault]]) -> list[str]:
        """Flip ``good``; the replicas whose flip failed on a rank (torn)."""
        s, st = self.steps, self.steps.state
        flips = _fan(s.calls.ledger, st, good, ShadowEngineRank.wt_flip, version,
                     epoch=next_epoch(), deadline=wall_deadline(deadline),
                     until=max(deadline, time.monotonic() + 10.0))
        torn = []
        for name in good:
            if name in flips:
                faults.setdefault(name, []).extend(flips[name])
                if not none_flipped(flips[name], len(st.replicas[name])):
                    torn.append(name)
                continue
            st.previous[name] = st.versions.get(name)
            st.versions[name] = version
            st.paused.discard(name)
        return sorted(torn)

    def _discard(self, names: list[str]) -> dict[str, list[RankFault]]:
        """Shadows of a failed transfer hold nothing complete (best effort, not waited for
        beyond :data:`DISCARD_WAIT_S`): no rollback onto them. The faults of ranks that
        did not discard (a dead one: its replica is dropped)."""
        st = self.steps.state
        for name in names:
            st.previous[name] = None
        if not names:
            return {}
        return _fan(self.steps.calls.ledger, st, names, ShadowEngineRank.wt_discard_shadow,
                    epoch=next_epoch(), until=time.monotonic() + DISCARD_WAIT_S)


def rollback(state: ControllerState, calls: ControlCalls, config: Any, audit: Any,
             in_flight: int | None) -> dict[str, int | None]:
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

