"""One weight update of :class:`~actors.controller.WeightTransferController`: the steps,
written once, and the two ways an update reaches the engines, handed in as a strategy.

::

    steps = UpdateSteps(state, calls, config, metrics=metrics, replicas=replica_ops,
                        served=watch)
    strategy = strategy_for(state, calls, config, pause=True)   # InPlace or Shadow
    outcome = steps.run(7, strategy, trace=False, auto_resync=True)
    outcome.report or outcome.error      # an UpdateReport, or the UpdateError to raise
    outcome.audit(started_at=t0, finished_at=t1)   # its audit line (actors.controller.audit)

:class:`InPlace` (``TransferConfig.apply="in_place"``) pauses the replicas, writes
their weights and resumes them; :class:`Shadow` (``apply="shadow"``) writes each
engine rank's second copy while the live one serves, then flips
(:mod:`weight_transfer.engines.shadow.store`). Every update runs under one
deadline, ``config.update_timeout_s`` from its start; the begin step may use the
first :data:`PAUSE_SHARE` of it, the writes and the check end at the latest
:data:`RESUME_SHARE` before it (so one stopped replica or trainer rank leaves the
others time to finish):

1. the delta round's directive (``config.delta``, :class:`~actors.controller.delta.DeltaChain`):
   anchor or delta, told to every trainer;
2. begin (the strategy): pause every running replica (``wt_pause``) or stage
   every replica's shadow (``wt_stage``; a delta first copies live into it),
   epoch-fenced, all ranks at once; a replica with a rank that is dead, stopped or
   failing is unfit, the others go on;
3. "go" to every trainer (only the version crosses Ray); the first rank that
   raises, or the transfer's deadline, ends the wait;
4. the completion fence (:func:`~actors.controller.checks.completion_fence`): a
   replica written by a rank that did not finish, with failed writes, or whose
   WRITEs did not all complete at their writer is unfit;
5. the delta round's apply (:func:`apply_delta`): every fit replica applies the
   records; the trainers re-send dense what it could not;
6. replica groups (``config.replica_groups``): followers filled from their leader;
7. one checksum request per engine rank of every fit replica: the integrity check
   of the written ranges and, where kept, the served-memory reference
   (:mod:`actors.controller.served`); a mismatch or a rank that did not answer
   makes its replica unfit;
8. end (the strategy): resume every fit replica (epoch and wall-clock deadline; an
   unfit one is torn), or flip every fit one and discard the shadow of every unfit
   one (it keeps serving its version, ``UpdateError.kept``; one whose flip failed
   on some rank is torn);
9. after a failure: hold every torn replica (version None, an epoch-fenced pause
   queued for ranks that did not answer, at most :data:`HOLD_WAIT_S` more for the
   others); drop replicas whose actors died from the plan; re-fill torn replicas
   whose ranks answer from a peer that holds the new version (``auto_resync``).

So a successful update ends within ``update_timeout_s``; a failed one raises
within ``update_timeout_s + HOLD_WAIT_S`` plus, when it drops a dead replica or
re-fills a torn one, one re-plan and one peer copy (each bounded by its timeout).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ray.exceptions import RayError

from actors.config import TransferConfig
from actors.controller.audit import (
    RefusedAudit,
    UpdateAudit,
    UpdateClock,
    record_failure,
    record_success,
    update_trace,
)
from actors.controller.calls import ControlCalls
from actors.controller.checks import (
    IntegrityResult,
    compare_and_hash,
    completion_fence,
    unchecked_faults,
    update_rows,
)
from actors.controller.delta import DeltaChain
from actors.controller.engine_control import (
    RankFault,
    dead_replicas,
    describe_faults,
    merge_faults,
    responsive,
)
from actors.controller.replicas import HOLD_WAIT_S, ReplicaOps, hold
from actors.controller.served import ServedWatch
from actors.controller.state import ControllerState
from actors.reports import RankReport, TrainerFault, UpdateReport
from weight_transfer.errors import BarrierRefusedError, FaultKind, UpdateError
from weight_transfer.integrity.served import ServedSums
from weight_transfer.observe.metrics import TransferMetrics
from weight_transfer.observe.phases import PhaseClock
from weight_transfer.observe.trace import write_chrome_trace

log = logging.getLogger(__name__)

__all__ = ["HOLD_WAIT_S", "PAUSE_SHARE", "RESUME_SHARE", "Ending", "UpdateError", "UpdateOutcome",
           "UpdateSteps", "UpdateStrategy", "apply_delta", "check_version", "refusals_of"]

PAUSE_SHARE = 0.25  # of update_timeout_s: the most the begin step (pause, stage) may take
RESUME_SHARE = 0.1  # of update_timeout_s: kept for the end step when the transfer overruns

Faults = dict[str, list[RankFault]]


def check_version(state: ControllerState, version: int) -> None:
    """ValueError unless ``version`` is an int above the last version attempted."""
    state.check_ready("update()")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"version must be an int, not {version!r}")
    if state.attempted is not None and version <= state.attempted:
        raise ValueError(f"version {version} must be greater than {state.attempted}, "
                         "the last version attempted")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Ending:
    """How the end step left the replicas: ``torn`` hold no complete version (they are
    held next); ``kept`` (shadow mode): replica -> the version it still serves, its live
    memory untouched by the failed transfer."""

    torn: tuple[str, ...] = ()
    kept: Mapping[str, int | None] = dataclasses.field(default_factory=dict)


class UpdateStrategy(Protocol):
    """What differs between the ways an update reaches the engines (module docstring)."""

    def begin(self, version: int, names: Sequence[str], *, until: float,
              base: bool) -> Faults:
        """Ready every replica of ``names`` for the writes of ``version`` by ``until``
        (``base``: a delta update, its records based on the version served); the faults."""

    def end(self, version: int, names: Sequence[str], good: Sequence[str], failed: set[str],
            faults: Faults, *, deadline: float) -> Ending:
        """Serve ``version`` on ``good`` (they got every byte); ``failed`` did not. Adds
        the faults of ranks that did not end well to ``faults``."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UpdateOutcome:
    """How one update ended: ``report`` (it succeeded) or ``error`` (to raise), with what
    the audit line records. ``crashed``: the update ended with an error of its own
    before it could collect reports (a pause or a check that raised)."""

    version: int
    replicas: tuple[str, ...]
    reports: tuple[RankReport, ...] = ()
    integrity: IntegrityResult | None = None
    report: UpdateReport | None = None
    error: Exception | None = None
    crashed: bool = False
    refusals: tuple[RefusedAudit, ...] = ()  # barrier arrivals refused (their own lines)

    def audit(self, *, started_at: float, finished_at: float) -> UpdateAudit:
        err = self.error
        return UpdateAudit(
            version=self.version, started_at=started_at, finished_at=finished_at,
            reports=self.reports, integrity=self.integrity, replicas=self.replicas,
            outcome="ok" if err is None else "failed",
            torn=tuple(err.torn) if isinstance(err, UpdateError) else (),
            error=None if err is None else (f"{type(err).__name__}: {err}" if self.crashed
                                            else str(err)))


def refusals_of(version: int, errors: Mapping[int, TrainerFault]
                ) -> tuple[RefusedAudit, ...]:
    """The audit lines of the barrier arrivals that trainer ranks refused."""
    return tuple(
        RefusedAudit(version=version, what="barrier arrival", rank=f.cause.rank,
                     tag=f.cause.tag, reason=f.cause.reason, by=f"trainer rank {r}",
                     at=time.time(), error=f.error)
        for r, f in sorted(errors.items()) if isinstance(f.cause, BarrierRefusedError))


def apply_delta(chain: DeltaChain, version: int, names: Sequence[str], failed: set[str],
                errors: bool, faults: Faults) -> set[str]:
    """The delta round's apply: every replica of ``names`` not ``failed`` applies the
    records of ``version`` (``chain``: the :class:`~actors.controller.delta.DeltaChain`);
    the trainers re-send dense what it could not apply. The replicas that must not take
    the version: every one of them when a trainer failed (``errors``) in a delta update
    (no repair) or when the apply or the repair failed (their faults added to ``faults``)."""
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
            why = f"applying the delta records failed: {err}"
    if why is None:
        return set()
    log.warning("delta version %d: replicas %s do not take it: %s", version, todo, why)
    for name in todo:
        faults.setdefault(name, []).append(RankFault(
            replica=name, rank=-1, kind=FaultKind.FAILED, method="delta apply", error=why))
    return set(todo)


class UpdateSteps:
    """The steps of one update over the controller's state; see the module docstring."""

    def __init__(self, state: ControllerState, calls: ControlCalls, config: TransferConfig,
                 *, metrics: TransferMetrics, replicas: ReplicaOps,
                 served: ServedWatch | None = None) -> None:
        self.state, self.calls, self.config = state, calls, config
        self.metrics, self.replica_ops, self.served = metrics, replicas, served
        self.delta = DeltaChain(state, calls, config) if config.delta else None

    def run(self, version: int, strategy: UpdateStrategy, *,
            trace: bool | str | os.PathLike, auto_resync: bool,
            after_transfer: Callable[[int], None] | None = None,
            overlap: bool | None = None) -> UpdateOutcome:
        """Move the trainers' weights into every replica as ``version`` (checked by
        :func:`check_version` first); ``after_transfer(version)``, a test hook, runs
        between the writes and the check."""
        st, ledger, delta = self.state, self.calls.ledger, self.delta
        timeout = self.config.update_timeout_s
        offset, snap, start = UpdateClock.wall_offset(), ledger.snapshot(), time.perf_counter()
        deadline = time.monotonic() + timeout
        writes_end = deadline - timeout * RESUME_SHARE  # the transfer and the check
        names, clock = list(st.replicas), PhaseClock()  # this process's wall and CPU per step
        if delta is not None:
            delta.before(version)  # anchor or delta (actors.controller.delta)
        clock.mark("directive")
        faults = strategy.begin(version, names, until=deadline - timeout * (1 - PAUSE_SHARE),
                                base=delta is not None and not delta.anchor)
        clock.mark("begin")
        begun = time.perf_counter()
        reports, errors = self.calls.go(st.trainers, version, trace=bool(trace),
                                        overlap=overlap, until=writes_end,
                                        budget_s=timeout * (1 - RESUME_SHARE))
        transferred = time.perf_counter()
        clock.mark("transfer")
        if after_transfer is not None:
            after_transfer(version)
        failed = self._fence(names, faults, reports, errors)
        clock.mark("fence")
        if delta is not None:
            failed |= apply_delta(delta, version, names, failed, bool(errors), faults)
        clock.mark("apply")
        merge_faults(faults, self.replica_ops.fill_groups(  # replica groups: peers fill followers
            version, faults, reports, errors, until=writes_end))
        failed |= set(faults)
        clock.mark("groups")
        check, sums = self._check(version, [n for n in names if n not in failed],
                                  list(reports.values()), writes_end)
        merge_faults(faults, unchecked_faults(check))  # ranks that did not answer the check
        failed |= set(check.torn)
        clock.mark("check")
        ending = strategy.end(version, names, [n for n in names if n not in failed], failed,
                              faults, deadline=deadline)
        clock.mark("end")
        if self.served is not None:
            self.served.commit(version, sums)
        done = UpdateOutcome(version=version, replicas=tuple(names),
                             reports=tuple(reports.values()), integrity=check,
                             refusals=refusals_of(version, errors))
        if errors or ending.torn or ending.kept:
            if delta is not None:
                delta.failed()  # the next update is a dense anchor
            merge_faults(faults, hold(st, self.calls, ending.torn, faults))
            record_failure(self.metrics, errors, reports, ending.torn, st.versions)
            err = self._fail(version, reports, errors, faults, ending, check, auto_resync)
            return dataclasses.replace(done, error=err)
        phases, clock = clock, UpdateClock(start=start, paused=begun, transferred=transferred,
                            end=time.perf_counter(), offset=offset)
        report = self._succeeded(version, clock, reports, names, ledger.since(snap), check,
                                 trace, phases=phases.as_dict())
        if delta is not None:  # the time rule's fixed part of a delta update
            delta.measured(report.seconds, report.transfer_seconds)
        return dataclasses.replace(done, report=report)

    def _succeeded(self, version: int, clock: UpdateClock, reports: dict[int, RankReport],
                   names: list[str], control: tuple[int, int], check: IntegrityResult | None,
                   trace: bool | str | os.PathLike,
                   phases: dict[str, dict[str, float]] | None = None) -> UpdateReport:
        """The report of a successful update (``control``: bytes and calls of the control
        plane; ``phases``: the controller's wall and CPU per step), recorded in the
        metrics; its trace written where ``trace`` is a path."""
        per_rank = list(reports.values())
        report = UpdateReport.combine(
            version=version, seconds=clock.end - clock.start, per_rank=per_rank,
            pause_seconds=clock.paused - clock.start, resume_seconds=clock.end - clock.transferred,
            control_bytes=control[0], control_calls=control[1], replicas=tuple(names),
            trace=self._trace(version, clock, per_rank) if trace else None, integrity=check,
            phases=phases or {})
        record_success(self.metrics, report, self.state.versions)
        if trace and not isinstance(trace, bool):
            write_chrome_trace(trace, [report.trace])
        return report

    def _trace(self, version: int, clock: UpdateClock, reports: list[RankReport]):
        cluster = self.config.cluster
        cap = getattr(self.config.transport_spec.options, "bandwidth_gbps", None)  # simnic only
        send = min(cluster.send_bytes_per_s, cap * 1e9) if cap else cluster.send_bytes_per_s
        return update_trace(version=version, clock=clock, reports=reports,
                            summary=self.state.summary, send_bytes_per_s=send,
                            recv_bytes_per_s=cluster.recv_bytes_per_s)

    def _fence(self, names: list[str], faults: Faults, reports: dict[int, RankReport],
               errors: dict[int, TrainerFault]) -> set[str]:
        """The replicas that cannot take the version after the writes: a fault so far,
        written by a trainer rank that failed, failed writes, or WRITEs whose completion
        the controller has not seen (no resume or flip before it: a fault each)."""
        st = self.state
        failed = set(faults)  # a replica that did not pause may have served while written
        for rank in errors:
            failed.update(st.summary.replicas_by_rank.get(rank, names))
        for rep in reports.values():
            failed.update(rep.failed_replicas)
        for name, why in completion_fence(st.summary.dest_bytes_by_rank, reports,
                                          replicas=[n for n in names if n not in failed]
                                          ).pending.items():
            failed.add(name)
            faults.setdefault(name, []).append(RankFault(
                replica=name, rank=-1, kind=FaultKind.FAILED, method="completion fence",
                error=why))
        return failed

    def _check(self, version: int, names: list[str], reports: list[RankReport],
               until: float) -> tuple[IntegrityResult, dict[str, ServedSums]]:
        """The integrity check of ``names`` and the served-memory reference of those that
        pass it, from one checksum request per engine rank."""
        st, policy = self.state, self.config.integrity
        check, hashed = compare_and_hash(
            mode=policy.mode, rows=update_rows(policy, reports, names),
            also={} if self.served is None else self.served.reference_rows(names),
            replicas={n: st.replicas[n] for n in names}, metas=st.engine_metas,
            call=self.calls.call, get=self.calls.ledger.get,
            timeout_s=max(0.0, until - time.monotonic()))
        good = [n for n in names if n not in check.torn]
        sums = {} if self.served is None else self.served.reference(version, good, reports,
                                                                      hashed)
        return check, sums

    def _fail(self, version: int, reports: dict[int, RankReport],
              errors: dict[int, TrainerFault], faults: Faults, ending: Ending,
              check: IntegrityResult | None, auto_resync: bool) -> UpdateError:
        """Drop dead replicas, re-fill the torn ones that answer; the error to raise."""
        st, torn = self.state, list(ending.torn)
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
        kept = {n: v for n, v in ending.kept.items() if n not in lost}
        return update_error(version, reports, errors, faults, torn=torn, lost=lost,
                            resynced=resynced, kept=kept, check=check, newest=st.newest())


def update_error(version: int, reports: Mapping[int, RankReport],
                 errors: Mapping[int, TrainerFault], faults: Mapping[str, list[RankFault]], *,
                 torn: list[str], lost: list[str], resynced: list[str],
                 kept: Mapping[str, int | None], check: IntegrityResult | None,
                 newest: int | None) -> UpdateError:
    """The UpdateError of a failed update, naming trainer ranks, replicas and their ranks
    (``kept``, shadow mode: replica -> the version it still serves, untouched)."""
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
    if kept:
        msg += (f". Shadow mode: replicas {sorted(kept)} were not touched and keep serving "
                f"versions {[kept[n] for n in sorted(kept)]}")
    log.error(msg)
    replica_kinds = {n: tuple(f.kind for f in fs) for n, fs in sorted(faults.items())}
    for name in check.torn if check is not None else ():
        replica_kinds.setdefault(name, (FaultKind.INTEGRITY,))
    return UpdateError(msg, version=version, ranks=problems, torn=torn, replicas=replicas,
                       lost=lost, resynced=resynced, rank_kinds=kinds,
                       replica_kinds=replica_kinds, kept=kept)
