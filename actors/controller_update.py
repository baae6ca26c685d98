"""One weight update of :class:`~actors.controller.WeightTransferController`, fault by fault.

``update(version)`` runs under one deadline, ``config.update_timeout_s`` from
its start, that bounds the pause, the transfer and the resume together; the
pause may use the first :data:`PAUSE_SHARE` of it, the transfer ends at the
latest :data:`RESUME_SHARE` before it (so one stopped replica or trainer rank
leaves the others time to finish):

1. pause every running replica (:func:`~actors.engine_control.fan_out`, one
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
   holds the new version (``ctl.auto_resync``); raise :class:`UpdateError`.

So a successful update ends within ``update_timeout_s``; a failed one raises
within ``update_timeout_s + HOLD_WAIT_S`` plus, when it drops a dead replica or
re-fills a torn one, one re-plan and one peer copy (each bounded by its
timeout).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence

import ray

from actors.audit import audited_update
from actors.engine_control import (
    RankFault,
    cause_of,
    dead_replicas,
    describe_faults,
    fan_out,
    next_epoch,
    responsive,
    wall_deadline,
)
from actors.integrity_check import IntegrityResult, verify_update
from actors.reports import RankReport, UpdateReport
from actors.telemetry import UpdateClock, record_failure, record_success, update_trace
from weight_transfer.engines.rank import EngineRank, method_name
from weight_transfer.trace import write_chrome_trace

log = logging.getLogger(__name__)

HOLD_WAIT_S = 5.0  # how long holding torn replicas waits for ranks that answer
PAUSE_SHARE = 0.25  # of update_timeout_s: the most the pause may take
RESUME_SHARE = 0.1  # of update_timeout_s: kept for the resume when the transfer overruns


class UpdateError(RuntimeError):
    """An update failed; ``torn`` replicas hold no complete version now.

    ``ranks``: trainer rank -> what went wrong; ``replicas``: replica -> what
    its ranks did (dead, unresponsive, failed); ``lost``: replicas dropped from
    the plan (an actor died); ``resynced``: torn replicas re-filled from a peer
    right after the failure (they hold ``version`` and serve again).
    """

    def __init__(self, message: str, *, version: int, ranks: dict[int, str], torn: list[str],
                 replicas: dict[str, str] | None = None, lost: Sequence[str] = (),
                 resynced: Sequence[str] = ()):
        super().__init__(message)
        self.version, self.ranks, self.torn = version, ranks, torn
        self.replicas = dict(replicas or {})
        self.lost, self.resynced = list(lost), list(resynced)


def check_faults(check: IntegrityResult) -> dict[str, list[RankFault]]:
    """The engine ranks that could not be checked (no answer, died, failed) as faults of
    their replicas, so they are held like ranks that missed a pause or a resume."""
    out: dict[str, list[RankFault]] = {}
    for m in check.mismatches:
        if m.actual is not None or any(f.rank == m.rank for f in out.get(m.replica, ())):
            continue
        kind = ("unresponsive" if m.error.startswith("did not answer") else
                "dead" if "ActorDiedError" in m.error else "failed")
        out.setdefault(m.replica, []).append(RankFault(
            replica=m.replica, rank=m.rank, kind=kind,
            method=method_name(EngineRank.wt_checksum), error=m.error))
    return out


def _merge(into: dict[str, list[RankFault]], more: Mapping[str, list[RankFault]]) -> None:
    for name, faults in more.items():
        into.setdefault(name, []).extend(faults)


class UpdateSteps:
    """The update of the controller (mixed into it); see the module docstring."""

    def _check_version(self, version: int) -> None:
        self._check_ready("update()")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be an int, not {version!r}")
        if self._attempted is not None and version <= self._attempted:
            raise ValueError(f"version {version} must be greater than {self._attempted}, "
                             "the last version attempted")

    def _newest(self) -> int | None:
        """The newest version some replica holds completely."""
        held = [v for v in self._versions.values() if v is not None]
        return max(held) if held else None

    @property
    def _current(self) -> int | None:
        return self._newest()

    @audited_update  # a failure the body does not record still leaves an audit line
    def update(self, version: int, *, trace: bool | str | os.PathLike = False) -> UpdateReport:
        """Move the trainers' current weights into every replica as ``version``.

        ``trace``: True brings every rank's spans back in ``report.trace``; a path
        also writes them there as a Chrome trace (Perfetto-readable JSON).
        Raises :class:`UpdateError` (see the module docstring) when a replica did
        not get the version.
        """
        self._check_version(version)
        self._attempted = version
        started_wall = time.time()  # audit record
        offset = UpdateClock.wall_offset()
        snap, start = self.ledger.snapshot(), time.perf_counter()
        timeout = self.config.update_timeout_s
        deadline = time.monotonic() + timeout
        names = list(self.replicas)
        faults: dict[str, list[RankFault]] = {}
        if self.pause_during_update:
            pause = [n for n in names if n not in self._paused]
            _merge(faults, fan_out(self.ledger, self.replicas, pause, EngineRank.wt_pause,
                                   timeout * PAUSE_SHARE, epoch=next_epoch(),
                                   until=deadline - timeout * (1 - PAUSE_SHARE)))
            self._paused.update(names)
        paused_at = time.perf_counter()
        reports, errors = self._run_trainers(version, bool(trace),
                                             deadline - timeout * RESUME_SHARE)
        transfer_done = time.perf_counter()
        if self.after_transfer is not None:  # test hook: between the writes and the check
            self.after_transfer(version)
        torn = set(faults)  # a replica that did not pause may have served while written
        for rank in errors:
            torn.update(self.summary.replicas_by_rank.get(rank, names))
        for rep in reports.values():
            torn.update(rep.failed_replicas)
        # Integrity (actors.integrity_check): after the writes, before any resume.
        check = verify_update(
            policy=self.config.integrity, reports=list(reports.values()),
            replicas={n: self.replicas[n] for n in names if n not in torn},
            metas=self._engine_metas, call=self.ledger.call, get=self.ledger.get,
            timeout_s=max(0.0, deadline - timeout * RESUME_SHARE - time.monotonic()))
        _merge(faults, check_faults(check))  # ranks that did not answer the check
        torn.update(check.torn)
        _merge(faults, self._finish(version, [n for n in names if n not in torn], deadline))
        torn.update(faults)
        if errors or torn:
            _merge(faults, self._hold(sorted(torn), faults))
            record_failure(self.metrics, errors, reports, sorted(torn), self._versions)
            err = self._fail(version, reports, errors, faults, sorted(torn), check)
            self._audit_update(version, started_wall, reports, check, names, err)
            raise err
        nbytes, calls = self.ledger.since(snap)
        end = time.perf_counter()
        clock = UpdateClock(start=start, paused=paused_at, transferred=transfer_done, end=end,
                            offset=offset)
        report = UpdateReport.combine(
            version=version, seconds=end - start, per_rank=list(reports.values()),
            pause_seconds=paused_at - start, resume_seconds=end - transfer_done,
            control_bytes=nbytes, control_calls=calls, replicas=tuple(names),
            trace=self._trace(version, clock, list(reports.values())) if trace else None,
            integrity=check.as_dict())
        record_success(self.metrics, report, self._versions)
        self._audit_update(version, started_wall, reports, check, names, None)
        if trace and not isinstance(trace, bool):
            write_chrome_trace(trace, [report.trace])
        return report

    def _trace(self, version: int, clock: UpdateClock, reports: list[RankReport]):
        cluster = self.config.cluster
        cap = getattr(self.config.transport_spec.options, "bandwidth_gbps", None)  # simnic only
        send = min(cluster.send_bytes_per_s, cap * 1e9) if cap else cluster.send_bytes_per_s
        return update_trace(version=version, clock=clock, reports=reports, summary=self.summary,
                            send_bytes_per_s=send, recv_bytes_per_s=cluster.recv_bytes_per_s)

    def _run_trainers(self, version: int, trace: bool,
                      deadline: float) -> tuple[dict[int, RankReport], dict[int, str]]:
        """Send "go"; stop waiting at the first rank that raised (others may wait for it)."""
        args = (version, True) if trace else (version,)  # only the version, unless traced
        refs = {self.ledger.call(t.wt_update, *args): r for r, t in enumerate(self.trainers)}
        pending, reports, errors = list(refs), {}, {}
        if self.progress is not None:
            self.progress("transfer", 0, len(refs))
        while pending and not errors:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ref in ready:
                try:
                    reports[refs[ref]] = self.ledger.get(ref)
                except ray.exceptions.RayError as err:
                    errors[refs[ref]] = cause_of(err)
            if self.progress is not None:
                self.progress("transfer", len(refs) - len(pending), len(refs))
        waited = self.config.update_timeout_s * (1 - RESUME_SHARE)
        for ref in pending:
            errors[refs[ref]] = ("did not finish: another rank failed" if errors else
                                 f"did not finish within {waited:.3g} s (update_timeout_s "
                                 f"less the resume's share)")
        return reports, errors

    def _finish(self, version: int, good: list[str], deadline: float) -> dict[str, list]:
        """Resume replicas that got every byte of ``version``; the faults of those that did
        not resume (they are torn)."""
        resume = [n for n in good if n in self._paused]
        faults = fan_out(self.ledger, self.replicas, resume, EngineRank.wt_resume, version,
                         epoch=next_epoch(), deadline=wall_deadline(deadline), until=deadline)
        self._paused.difference_update(n for n in resume if n not in faults)
        running = [n for n in good if n not in resume]
        _merge(faults, fan_out(self.ledger, self.replicas, running, EngineRank.wt_set_version,
                               version, epoch=next_epoch(), until=deadline))
        for n in good:
            if n not in faults:
                self._versions[n] = version
        return faults

    def _hold(self, torn: Sequence[str],
              faults: Mapping[str, Sequence[RankFault]]) -> dict[str, list[RankFault]]:
        """Version None and paused for every rank of ``torn``: an epoch-fenced pause, queued
        for ranks that did not answer (not waited for), waited for the others. Returns the
        ranks found dead on the way."""
        if not torn:
            return {}
        epoch, refs, labels, dead = next_epoch(), [], [], {}
        for name in torn:
            self._versions[name] = None
            silent = {f.rank for f in faults.get(name, ()) if f.kind in ("dead", "unresponsive")}
            for rank, actor in enumerate(self.replicas[name]):
                ref = self.ledger.call(actor.wt_pause, HOLD_WAIT_S, epoch=epoch)
                if rank not in silent:
                    refs.append(ref)
                    labels.append((name, rank))
        self._paused.update(torn)
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=HOLD_WAIT_S) if refs else (
            [], [])
        for ref, (name, rank) in zip(refs, labels, strict=True):
            if ref in pending:
                log.error("could not hold %s/tp%d: no answer within %g s", name, rank,
                          HOLD_WAIT_S)
                continue
            try:
                self.ledger.get(ref)
            except ray.exceptions.RayError as err:
                log.error("could not hold %s/tp%d: %s", name, rank, cause_of(err))
                if isinstance(err, ray.exceptions.ActorDiedError):
                    dead.setdefault(name, []).append(RankFault(
                        replica=name, rank=rank, kind="dead",
                        method=method_name(EngineRank.wt_pause), error=cause_of(err)))
        return dead

    def _fail(self, version: int, reports: dict[int, RankReport], errors: dict[int, str],
              faults: dict[str, list[RankFault]], torn: list[str],
              check: IntegrityResult | None = None) -> UpdateError:
        """Drop dead replicas, re-fill the torn ones that answer; the error to raise."""
        lost = [n for n in dead_replicas(faults) if len(self.replicas) > 1]
        for name in lost:
            try:
                self.remove_replica(name)
            except Exception as exc:  # the error below still names it; it stays torn
                log.error("could not drop the dead replica %s: %s", name, exc)
                lost.remove(name)
        resynced = []
        if self.auto_resync and self._newest() is not None:
            for name in torn:
                if name in self.replicas and responsive(faults, name):
                    try:
                        self.resync(name)
                        resynced.append(name)
                    except (RuntimeError, TimeoutError, ValueError) as exc:
                        log.error("re-sync of torn replica %s failed: %s", name, exc)
        return self._update_error(version, reports, errors, faults, torn, lost, resynced, check)

    def _update_error(self, version: int, reports: dict[int, RankReport],
                      errors: dict[int, str], faults: dict[str, list[RankFault]],
                      torn: list[str], lost: list[str], resynced: list[str],
                      check: IntegrityResult | None = None) -> UpdateError:
        problems = dict(errors)
        for rank, rep in sorted(reports.items()):
            for f in rep.failures:
                problems[rank] = (f"{f.count} writes ({f.nbytes} B) into {f.replica} "
                                  f"({f.owner}) failed: {f.error}")
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
            msg += f"; {resynced} re-synced from a peer to version {self._newest()}"
        log.error(msg)
        return UpdateError(msg, version=version, ranks=problems, torn=torn, replicas=replicas,
                           lost=lost, resynced=resynced)

    def _audit_update(self, version: int, started_at: float, reports: dict[int, RankReport],
                      check: IntegrityResult, names: list[str], err: Exception | None) -> None:
        """One line in the audit log (actors.audit), if the configuration names one."""
        if err is not None:
            err.audited = True  # audited_update records nothing more
        if self.audit is not None:
            self.audit.record_update(
                version=version, started_at=started_at, finished_at=time.time(),
                reports=list(reports.values()), integrity=check, replicas=names,
                outcome="ok" if err is None else "failed",
                torn=[] if err is None else getattr(err, "torn", []),
                error=None if err is None else str(err))
