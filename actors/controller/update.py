"""One weight update of :class:`~actors.controller.WeightTransferController`, fault by fault.

::

    steps = UpdateSteps(state, calls, config, metrics=metrics, replicas=replica_ops)
    outcome = steps.run(7, trace=False, pause=True, auto_resync=True)
    outcome.report or outcome.error      # an UpdateReport, or the UpdateError to raise
    outcome.audit(started_at=t0, finished_at=t1)   # its audit line (actors.controller.audit)

``update(version)`` runs under one deadline, ``config.update_timeout_s`` from
its start, that bounds the pause, the transfer and the resume together; the
pause may use the first :data:`PAUSE_SHARE` of it, the transfer ends at the
latest :data:`RESUME_SHARE` before it (so one stopped replica or trainer rank
leaves the others time to finish):

1. pause every running replica (:func:`~actors.controller.engine_control.fan_out`, one
   epoch-fenced ``wt_pause`` per rank, all at once); a replica with a rank
   that is dead, stopped or failing is torn, the others go on;
2. "go" to every trainer (only the version crosses Ray); the first rank that
   raises, or the transfer's deadline, ends the wait; replicas written by a
   rank that did not finish, and replicas with failed writes, are torn;
3. resume every replica that got all its bytes and paused (the resume carries
   the epoch and a wall-clock deadline; a late one is refused by the rank);
   a replica with a rank that did not resume is torn;
4. hold every torn replica (version None, an epoch-fenced pause; ranks that
   did not answer get it queued and are not waited for, at most
   :data:`HOLD_WAIT_S` more for the others); drop replicas whose actors died
   from the plan; re-fill torn replicas whose ranks answer from a peer that
   holds the new version (``ctl.auto_resync``); the outcome carries the
   :class:`~weight_transfer.errors.UpdateError` the controller raises.

So a successful update ends within ``update_timeout_s``; a failed one raises
within ``update_timeout_s + HOLD_WAIT_S`` plus, when it drops a dead replica or
re-fills a torn one, one re-plan and one peer copy (each bounded by its
timeout).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping

import ray

from actors.config import TransferConfig
from actors.controller.calls import ControlCalls
from actors.controller.checks import IntegrityResult, completion_fence, verify_update
from actors.controller.delta import DeltaChain
from actors.controller.engine_control import (
    RankFault,
    cause_of,
    dead_replicas,
    describe_faults,
    fan_out,
    next_epoch,
    responsive,
    wall_deadline,
)
from actors.controller.outcome import (
    PAUSE_SHARE,
    RESUME_SHARE,
    UpdateOutcome,
    check_faults,
    refusals_of,
)
from actors.controller.outcome import (
    merge_faults as _merge,
)
from actors.controller.replicas import HOLD_WAIT_S, ReplicaOps, hold
from actors.controller.served import ServedWatch
from actors.controller.shadow import ShadowSteps
from actors.controller.state import ControllerState
from actors.controller.telemetry import UpdateClock, record_failure, record_success, update_trace
from actors.reports import RankReport, TrainerFault, UpdateReport
from weight_transfer.engines.rank import EngineRank
from weight_transfer.errors import FaultKind, UpdateError
from weight_transfer.observe.metrics import TransferMetrics
from weight_transfer.observe.trace import write_chrome_trace

log = logging.getLogger(__name__)

__all__ = ["HOLD_WAIT_S", "PAUSE_SHARE", "RESUME_SHARE", "UpdateError", "UpdateOutcome",
           "UpdateSteps", "check_faults", "check_version"]


def check_version(state: ControllerState, version: int) -> None:
    """ValueError unless ``version`` is an int above the last version attempted."""
    state.check_ready("update()")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"version must be an int, not {version!r}")
    if state.attempted is not None and version <= state.attempted:
        raise ValueError(f"version {version} must be greater than {state.attempted}, "
                         "the last version attempted")


class UpdateSteps:
    """The steps of one update over the controller's state; see the module docstring."""

    def __init__(self, state: ControllerState, calls: ControlCalls, config: TransferConfig,
                 *, metrics: TransferMetrics, replicas: ReplicaOps,
                 served: ServedWatch | None = None) -> None:
        self.state, self.calls, self.config = state, calls, config
        self.metrics, self.replica_ops, self.served = metrics, replicas, served
        self.delta = DeltaChain(state, calls, config) if config.delta else None

    def run(self, version: int, *, trace: bool | str | os.PathLike, pause: bool,
            auto_resync: bool, after_transfer: Callable[[int], None] | None = None
            ) -> UpdateOutcome:
        """Move the trainers' weights into every replica as ``version`` (checked by
        :func:`check_version` first); ``after_transfer(version)``, a test hook, runs
        between the writes and the check."""
        if self.config.apply == "shadow":
            return ShadowSteps(self).run(version, trace=trace, auto_resync=auto_resync,
                                         after_transfer=after_transfer)
        st, ledger = self.state, self.calls.ledger
        offset = UpdateClock.wall_offset()
        snap, start = ledger.snapshot(), time.perf_counter()
        timeout = self.config.update_timeout_s
        deadline = time.monotonic() + timeout
        names = list(st.replicas)
        faults: dict[str, list[RankFault]] = {}
        if pause:
            _merge(faults, fan_out(ledger, st.replicas, [n for n in names if n not in st.paused],
                                   EngineRank.wt_pause, timeout * PAUSE_SHARE, epoch=next_epoch(),
                                   until=deadline - timeout * (1 - PAUSE_SHARE)))
            st.paused.update(names)
        paused_at = time.perf_counter()
        if self.delta is not None:
            self.delta.before(version)  # anchor or delta (actors.controller.delta)
        reports, errors = self._run_trainers(version, bool(trace),
                                             deadline - timeout * RESUME_SHARE)
        if self.delta is not None and not errors:  # apply in place at finish, then repair
            failed = set(faults) | {n for r in reports.values() for n in r.failed_replicas}
            self.delta.after(version, [n for n in names if n not in failed])
        transfer_done = time.perf_counter()
        if after_transfer is not None:
            after_transfer(version)
        _merge(faults, self.replica_ops.fill_groups(  # replica groups: peers fill followers
            version, faults, reports, errors, until=deadline - timeout * RESUME_SHARE))
        torn, check = self._check_and_resume(version, names, faults, reports, errors, deadline)
        done = UpdateOutcome(version=version, replicas=tuple(names),
                             reports=tuple(reports.values()), integrity=check,
                             refusals=refusals_of(version, errors))
        if errors or torn:
            if self.delta is not None:
                self.delta.failed()  # the next update is a dense anchor
            _merge(faults, hold(st, self.calls, torn, faults))
            record_failure(self.metrics, errors, reports, torn, st.versions)
            err = self._fail(version, reports, errors, faults, torn, check, auto_resync)
            return dataclasses.replace(done, error=err)
        clock = UpdateClock(start=start, paused=paused_at, transferred=transfer_done,
                            end=time.perf_counter(), offset=offset)
        report = self.succeeded(version, clock, reports, names, ledger.since(snap), check, trace)
        return dataclasses.replace(done, report=report)

    def succeeded(self, version: int, clock: UpdateClock, reports: dict[int, RankReport],
                  names: list[str], control: tuple[int, int], check: IntegrityResult | None,
                  trace: bool | str | os.PathLike) -> UpdateReport:
        """The report of a successful update (``control``: bytes and calls of the control
        plane), recorded in the metrics; its trace written where ``trace`` is a path."""
        per_rank = list(reports.values())
        report = UpdateReport.combine(
            version=version, seconds=clock.end - clock.start, per_rank=per_rank,
            pause_seconds=clock.paused - clock.start, resume_seconds=clock.end - clock.transferred,
            control_bytes=control[0], control_calls=control[1], replicas=tuple(names),
            trace=self._trace(version, clock, per_rank) if trace else None, integrity=check)
        record_success(self.metrics, report, self.state.versions)
        if trace and not isinstance(trace, bool):
            write_chrome_trace(trace, [report.trace])
        return report

    def _check_and_resume(self, version: int, names: list[str],
                          faults: dict[str, list[RankFault]], reports: dict[int, RankReport],
                          errors: dict[int, TrainerFault], deadline: float
                          ) -> tuple[list[str], IntegrityResult]:
        """After the writes: the integrity check, then the resume of every replica that got
        all its bytes; the torn replicas (sorted) and the check. ``faults`` gains the
        ranks that did not answer the check or the resume."""
        st = self.state
        torn = set(faults)  # a replica that did not pause may have served while written
        for rank in errors:
            torn.update(st.summary.replicas_by_rank.get(rank, names))
        for rep in reports.values():
            torn.update(rep.failed_replicas)
        # The completion fence: no resume before every WRITE into the replica completed and
        # its report is here (a replica of a rank that failed is torn above already).
        for name, why in completion_fence(st.summary.dest_bytes_by_rank, reports,
                                          replicas=[n for n in names if n not in torn]
                                          ).pending.items():
            torn.add(name)
            faults.setdefault(name, []).append(RankFault(
                replica=name, rank=-1, kind=FaultKind.FAILED, method="completion fence",
                error=why))
        check = verify_update(
            policy=self.config.integrity, reports=list(reports.values()),
            replicas={n: st.replicas[n] for n in names if n not in torn},
            metas=st.engine_metas, call=self.calls.call, get=self.calls.ledger.get,
            timeout_s=max(0.0, deadline - self.config.update_timeout_s * RESUME_SHARE
                          - time.monotonic()))
        _merge(faults, check_faults(check))  # ranks that did not answer the check
        torn.update(check.torn)
        good = [n for n in names if n not in torn]
        # Checksums of every served byte, for checks after the resume (still paused here).
        sums = {} if self.served is None else self.served.reference(
            version, good, list(reports.values()), timeout_s=max(
                0.0, deadline - self.config.update_timeout_s * RESUME_SHARE - time.monotonic()))
        _merge(faults, self._finish(version, good, deadline))
        torn.update(faults)
        if self.served is not None:
            self.served.commit(version, sums)
        return sorted(torn), check

    def _trace(self, version: int, clock: UpdateClock, reports: list[RankReport]):
        cluster = self.config.cluster
        cap = getattr(self.config.transport_spec.options, "bandwidth_gbps", None)  # simnic only
        send = min(cluster.send_bytes_per_s, cap * 1e9) if cap else cluster.send_bytes_per_s
        return update_trace(version=version, clock=clock, reports=reports,
                            summary=self.state.summary, send_bytes_per_s=send,
                            recv_bytes_per_s=cluster.recv_bytes_per_s)

    def _run_trainers(self, version: int, trace: bool, deadline: float
                      ) -> tuple[dict[int, RankReport], dict[int, TrainerFault]]:
        """Send "go"; stop waiting at the first rank that raised (others may wait for it)."""
        args = (version, True) if trace else (version,)  # only the version, unless traced
        ledger, progress = self.calls.ledger, self.calls.progress
        refs = {ledger.call(t.wt_update, *args): r for r, t in enumerate(self.state.trainers)}
        pending, reports, errors = list(refs), {}, {}
        if progress is not None:
            progress("transfer", 0, len(refs))
        while pending and not errors:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ref in ready:
                try:
                    reports[refs[ref]] = ledger.get(ref)
                except ray.exceptions.RayError as err:
                    errors[refs[ref]] = TrainerFault(rank=refs[ref], kind=FaultKind.FAILED,
                                                     error=cause_of(err),
                                                     cause=getattr(err, "cause", None))
            if progress is not None:
                progress("transfer", len(refs) - len(pending), len(refs))
        waited = self.config.update_timeout_s * (1 - RESUME_SHARE)
        for ref in pending:
            errors[refs[ref]] = (
                TrainerFault(rank=refs[ref], kind=FaultKind.ABORTED,
                             error="did not finish: another rank failed") if errors else
                TrainerFault(rank=refs[ref], kind=FaultKind.TIMEOUT,
                             error=f"did not finish within {waited:.3g} s (update_timeout_s "
                                   f"less the resume's share)"))
        return reports, errors

    def _finish(self, version: int, good: list[str], deadline: float) -> dict[str, list]:
        """Resume replicas that got every byte of ``version``; the faults of those that did
        not resume (they are torn)."""
        st, ledger = self.state, self.calls.ledger
        resume = [n for n in good if n in st.paused]
        faults = fan_out(ledger, st.replicas, resume, EngineRank.wt_resume, version,
                         epoch=next_epoch(), deadline=wall_deadline(deadline), until=deadline)
        st.paused.difference_update(n for n in resume if n not in faults)
        running = [n for n in good if n not in resume]
        _merge(faults, fan_out(ledger, st.replicas, running, EngineRank.wt_set_version, version,
                               epoch=next_epoch(), until=deadline))
        for n in good:
            if n not in faults:
                st.versions[n] = version
        return faults

    def _fail(self, version: int, reports: dict[int, RankReport],
              errors: dict[int, TrainerFault], faults: dict[str, list[RankFault]],
              torn: list[str], check: IntegrityResult | None, auto_resync: bool
              ) -> UpdateError:
        """Drop dead replicas, re-fill the torn ones that answer; the error to raise."""
        st = self.state
        lost = [n for n in dead_replicas(faults) if len(st.replicas) > 1]
        for name in list(lost):
            try:
                self.replica_ops.remove(name)
            except Exception as exc:  # the error below still names it; it stays torn
                log.error("could not drop the dead replica %s: %s", name, exc)
                lost.remove(name)
        resynced = []
        if auto_resync and st.newest() is not None:
            for name in torn:
                if name in st.replicas and responsive(faults, name):
                    try:
                        self.replica_ops.resync(name)
                        resynced.append(name)
                    except (RuntimeError, TimeoutError, ValueError) as exc:
                        log.error("re-sync of torn replica %s failed: %s", name, exc)
        return update_error(version, reports, errors, faults, torn=torn, lost=lost,
                            resynced=resynced, check=check, newest=st.newest())


def update_error(version: int, reports: Mapping[int, RankReport],
                 errors: Mapping[int, TrainerFault], faults: Mapping[str, list[RankFault]], *,
                 torn: list[str], lost: list[str], resynced: list[str],
                 check: IntegrityResult | None, newest: int | None) -> UpdateError:
    """The UpdateError of a failed update, naming trainer ranks, replicas and their ranks."""
    problems = {rank: f.error for rank, f in errors.items()}
    kinds = {rank: f.kind for rank, f in errors.items()}
    for rank, rep in sorted(reports.items()):
        for f in rep.failures:
            problems[rank] = (f"{f.count} writes ({f.nbytes} B) into {f.replica} "
                              f"({f.owner}) failed: {f.error}")
            kinds[rank] = FaultKind.FAILED
    replicas = describe_faults(faults)
    parts = [f"trainer rank {r}: {msg}" for r, msg in sorted(problems.items())]
    parts += [f"replica {n}: {msg}" for n, msg in replicas.items()]
    if check is not None and not check.ok:
        parts.append(check.message())
    who = (f"trainer ranks {sorted(problems)}" if problems else
           f"replicas {sorted(replicas) or sorted(torn)}")
    msg = f"update to version {version} failed on {who}: {'; '.join(parts).rstrip('.')}. "
    held = [n for n in torn if n not in lost and n not in resynced]
    msg += f"Replicas {torn} are torn"
    if held:
        msg += f"; {held} stay paused (weights_version None)"
    if lost:
        msg += f"; {lost} lost (an actor died) and dropped from the plan"
    if resynced:
        msg += f"; {resynced} re-synced from a peer to version {newest}"
    log.error(msg)
    replica_kinds = {n: tuple(f.kind for f in fs) for n, fs in sorted(faults.items())}
    for name in check.torn if check is not None else ():
        replica_kinds.setdefault(name, (FaultKind.INTEGRITY,))
    return UpdateError(msg, version=version, ranks=problems, torn=torn, replicas=replicas,
                       lost=lost, resynced=resynced, rank_kinds=kinds,
                       replica_kinds=replica_kinds)
