"""What the controller records: an audit log of JSON lines (one per update, re-sync and check
of served memory, appended to a file), and the metrics and trace of each update.

The controller records every update, successful or not, and every re-sync of a
replica from a peer, when the configuration names a file
(``TransferConfig.audit_path``; None: no log)::

    audit = open_audit("runs/audit.jsonl")     # None: NoAudit, which records nothing
    audit.record(UpdateAudit(version=7, started_at=t0, finished_at=t1, reports=rank_reports,
                             integrity=result, outcome="ok", replicas=("engine0",)))
    audit.record(ResyncAudit(version=7, source="engine0", target="engine1", started_at=t0,
                             finished_at=t1, pairs={("engine0/tp0", "engine1/tp0"): 4096},
                             outcome="ok"))
    read_audit("runs/audit.jsonl")       # the records, as dicts, in order

A check of served memory between updates (``ctl.check_integrity()`` or the
background check, :mod:`actors.controller.served`) appends a ``check`` line:
``mode``, ``versions`` (replica -> version it held), ``integrity``, ``bad``
(replicas whose bytes differ), ``healed`` (re-synced from a peer), ``torn``
(bad and not healed), ``unchecked`` (serving without checksums), ``outcome``.

A ``rollback`` line records ``ctl.rollback()`` (shadow mode): ``before`` and
``after`` (replica -> version), ``outcome``, ``torn``, ``error``.

A ``refused`` line records an arrival at a trainers' barrier that no rank of the
setup made (:class:`RefusedAudit`: what, rank, tag, reason, by whom).

Update and re-sync lines: ``kind`` (update or resync), ``version``, ``started_at`` and
``finished_at`` (Unix seconds), ``seconds``, ``bytes`` (total) and ``pairs``
(``[{"src": "trainer0", "dst": "engine0/tp1", "bytes": n}, ...]``: landed bytes
per source and destination rank), ``integrity`` (the checksum mode, ranges and
bytes compared, ok, mismatches; null where no check ran), ``outcome`` (``ok``
or ``failed``), ``torn`` (replicas left torn), ``error`` (the message, or null);
update lines also carry ``refused``: per engine rank, the connections and writes
its NICs refused since setup (the ``tcp`` transport counts them; other ranks
are left out), asked of the engines after each update when a log is written.

The metrics, trace and progress of an update (plain functions over its reports,
so they are tested without Ray), exported by the controller beside the audit line::

    record_success(metrics, report, versions)      # update seconds, bytes, replica versions
    record_failure(metrics, errors, reports, torn, versions)  # failures by kind, versions
    trace = update_trace(version=7, clock=times, reports=..., summary=..., config=cfg)

Failure kinds the controller counts (one per trainer rank or replica), from each
trainer rank's :class:`~actors.reports.TrainerFault` kind (:data:`RANK_FAILURES`):
``timeout`` (a rank did not finish in time), ``rank_error`` (a rank raised), ``writes_failed``
(a rank reported WRITEs that did not land), ``torn_replica`` (a replica left
without a complete version). The trainer ranks count each failed WRITE by its
error class (``PeerUnreachableError``, ``RemoteAccessError``) in their own process.
``ProgressHook`` is what the controller calls while it waits on actors:
``hook(phase, done, total)``; ``wt demo`` draws it as a progress bar.

Append-safe: each record is one ``write`` of a whole line to a file opened
with ``O_APPEND`` (so lines of several writers never interleave), then
``fsync``; a failure to write the log is logged, never raised into an update.
The controller calls ``record`` once per update and once per re-sync, where the
outcome is known (also for an update that failed before any rank reported).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.messages import PlanSummary
from actors.reports import RankReport, TrainerFault, UpdateReport
from weight_transfer.errors import FaultKind
from weight_transfer.observe.metrics import TransferMetrics
from weight_transfer.observe.trace import UpdateTrace, nic_bound_seconds

log = logging.getLogger(__name__)


def update_pairs(reports: Iterable[Any]) -> list[dict[str, Any]]:
    """Landed bytes per (trainer rank, engine rank) from RankReports' ``dest_bytes``."""
    return [{"src": f"trainer{r.rank}", "dst": dst, "bytes": int(n)}
            for r in sorted(reports, key=lambda r: r.rank)
            for dst, n in sorted(r.transfer.dest_bytes.items())]


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateAudit:
    """One update's line (``reports``: the trainers' RankReports that came back)."""

    version: int
    started_at: float
    finished_at: float
    outcome: str  # "ok" or "failed"
    reports: tuple[Any, ...] = ()
    torn: tuple[str, ...] = ()
    integrity: Any = None  # actors.controller.checks.IntegrityResult, or None: no check ran
    replicas: tuple[str, ...] = ()
    error: str | None = None
    retries: int | None = None  # None: summed from the reports
    # engine rank -> {"connections": n, "writes": m} its NICs refused since setup (tcp)
    refused: Mapping[str, Mapping[str, int]] = field(default_factory=dict, hash=False)

    def as_record(self) -> dict[str, Any]:
        pairs = update_pairs(self.reports)
        retries = (sum(r.transfer.retries for r in self.reports) if self.retries is None
                   else self.retries)
        return {
            "kind": "update", "version": self.version, "started_at": self.started_at,
            "finished_at": self.finished_at, "seconds": self.finished_at - self.started_at,
            "bytes": sum(p["bytes"] for p in pairs), "pairs": pairs,
            "integrity": None if self.integrity is None else self.integrity.as_dict(),
            "outcome": self.outcome, "torn": sorted(self.torn), "replicas": list(self.replicas),
            "retries": retries, "error": self.error,
            "refused": {rank: dict(n) for rank, n in sorted(self.refused.items())},
        }


def refused_counts(ranks: Iterable[str], stats: Iterable[Mapping[str, int]]
                   ) -> dict[str, dict[str, int]]:
    """Engine ranks whose NICs refused connections or writes (``wt_nic_stats``), with
    the counts; ranks that refused nothing are left out."""
    out = {}
    for rank, s in zip(ranks, stats, strict=True):
        counts = {"connections": int(s.get("refused_connections", 0)),
                  "writes": int(s.get("refused_writes", 0))}
        if any(counts.values()):
            out[rank] = counts
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ResyncAudit:
    """One re-sync of replica ``target`` from peer ``source`` (``pairs``: bytes per
    (source rank, target rank), e.g. ``("engine0/tp0", "engine1/tp0")``)."""

    version: int | None
    source: str
    target: str
    started_at: float
    finished_at: float
    outcome: str  # "ok" or "failed"
    pairs: Mapping[tuple[str, str], int] = field(default_factory=dict, hash=False)
    integrity: Any = None
    error: str | None = None

    def as_record(self) -> dict[str, Any]:
        rows = [{"src": s, "dst": d, "bytes": int(n)} for (s, d), n in sorted(self.pairs.items())]
        return {
            "kind": "resync", "version": self.version, "source": self.source,
            "target": self.target, "started_at": self.started_at,
            "finished_at": self.finished_at, "seconds": self.finished_at - self.started_at,
            "bytes": sum(r["bytes"] for r in rows), "pairs": rows,
            "integrity": None if self.integrity is None else self.integrity.as_dict(),
            "outcome": self.outcome, "torn": [] if self.outcome == "ok" else [self.target],
            "error": self.error,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RefusedAudit:
    """Something no one that setup planned tried, refused: ``what`` (``barrier arrival``),
    on behalf of whom (``rank``), where (``tag``), what was wrong (``reason``: forged,
    pre-arrived, deleted), noticed by ``by`` at ``at`` (Unix seconds)."""

    version: int | None
    what: str
    rank: int
    tag: str
    reason: str
    by: str
    at: float
    error: str = ""

    def as_record(self) -> dict[str, Any]:
        return {"kind": "refused", "version": self.version, "what": self.what,
                "rank": self.rank, "tag": self.tag, "reason": self.reason, "by": self.by,
                "at": self.at, "error": self.error}


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckAudit:
    """One check of served memory between updates (``mode`` full or tick,
    :mod:`actors.controller.served`): ``bad`` replicas whose bytes differ from the checksums of
    the version they hold, ``healed`` those re-synced from a peer, ``unchecked`` serving
    replicas without checksums to compare with."""

    mode: str
    started_at: float
    finished_at: float
    versions: Mapping[str, int | None] = field(default_factory=dict, hash=False)
    integrity: Any = None
    bad: tuple[str, ...] = ()
    healed: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()
    error: str | None = None

    def as_record(self) -> dict[str, Any]:
        return {
            "kind": "check", "mode": self.mode, "versions": dict(sorted(self.versions.items())),
            "started_at": self.started_at, "finished_at": self.finished_at,
            "seconds": self.finished_at - self.started_at,
            "integrity": None if self.integrity is None else self.integrity.as_dict(),
            "outcome": "ok" if not self.bad and self.error is None else "failed",
            "torn": sorted(set(self.bad) - set(self.healed)), "bad": sorted(self.bad),
            "healed": sorted(self.healed), "unchecked": sorted(self.unchecked),
            "error": self.error,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RollbackAudit:
    """One ``ctl.rollback()`` (shadow mode): the versions before and after, per replica."""

    started_at: float
    finished_at: float
    before: Mapping[str, int | None] = field(default_factory=dict, hash=False)
    after: Mapping[str, int | None] = field(default_factory=dict, hash=False)
    torn: tuple[str, ...] = ()
    error: str | None = None

    def as_record(self) -> dict[str, Any]:
        return {"kind": "rollback", "started_at": self.started_at,
                "finished_at": self.finished_at, "seconds": self.finished_at - self.started_at,
                "before": dict(sorted(self.before.items())),
                "after": dict(sorted(self.after.items())),
                "outcome": "ok" if self.error is None else "failed",
                "torn": sorted(self.torn), "error": self.error}


AuditEntry = UpdateAudit | ResyncAudit | CheckAudit | RefusedAudit | RollbackAudit


class AuditLog:
    """Appends records to ``path`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise ValueError(f"audit_path {str(self.path)!r} is a directory, not a file")
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, entry: AuditEntry) -> None:
        """Append ``entry`` as one JSON line (a failure to write is logged, not raised)."""
        record = entry.as_record()
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            log.error("audit log %s: could not append a %s record: %s", self.path,
                      record.get("kind"), err)


class NoAudit:
    """The audit log of a configuration that names none: records nothing."""

    def record(self, entry: AuditEntry) -> None:
        return None


def open_audit(path: str | os.PathLike | None) -> AuditLog | NoAudit:
    """The audit log at ``path``, or one that records nothing (``path`` None)."""
    return NoAudit() if path is None else AuditLog(path)


def read_audit(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of an audit log, in order (ValueError naming a line that is not JSON)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{i}: not a JSON line: {err}") from None
    return out


ProgressHook = Callable[[str, int, int], None]

# A trainer rank's fault kind -> the failure it counts as (None: a consequence, counted
# where it started).
RANK_FAILURES: dict[FaultKind, str | None] = {
    FaultKind.TIMEOUT: "timeout",
    FaultKind.ABORTED: None,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateClock:
    """The controller's phase boundaries of one update, on its ``perf_counter`` clock."""

    start: float
    paused: float
    transferred: float
    end: float
    offset: float  # time.time() - time.perf_counter() when the update started

    @staticmethod
    def wall_offset() -> float:
        return time.time() - time.perf_counter()


def replica_versions(metrics: TransferMetrics, versions: Mapping[str, int | None]) -> None:
    for name, version in versions.items():
        metrics.replica_version(name, version)


def record_success(metrics: TransferMetrics, report: UpdateReport,
                   versions: Mapping[str, int | None]) -> None:
    metrics.update_done(seconds=report.seconds, nbytes=report.bytes)
    replica_versions(metrics, versions)


def failure_kinds(errors: Mapping[int, TrainerFault], reports: Mapping[int, RankReport],
                  torn: Sequence[str]) -> dict[str, int]:
    """``{kind: count}`` of one failed update (see the module docstring)."""
    kinds: dict[str, int] = {}
    for fault in errors.values():
        kind = RANK_FAILURES.get(fault.kind, "rank_error")
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0) + 1
    failed = sum(1 for rep in reports.values() if rep.failures)
    if failed:
        kinds["writes_failed"] = failed
    if torn:
        kinds["torn_replica"] = len(torn)
    return kinds


def record_failure(metrics: TransferMetrics, errors: Mapping[int, TrainerFault],
                   reports: Mapping[int, RankReport], torn: Sequence[str],
                   versions: Mapping[str, int | None]) -> None:
    for kind, count in failure_kinds(errors, reports, torn).items():
        metrics.failure(kind, count)
    replica_versions(metrics, versions)


def update_trace(*, version: int, clock: UpdateClock, reports: Sequence[RankReport],
                 summary: PlanSummary, send_bytes_per_s: float,
                 recv_bytes_per_s: float) -> UpdateTrace:
    """The update's trace from its traced rank reports and the controller's phases."""
    missing = [r.rank for r in reports if r.trace is None]
    if missing:
        raise RuntimeError(f"update {version}: trainer ranks {missing} returned no trace")

    def wall(t: float) -> float:
        return t + clock.offset

    return UpdateTrace(
        version=version,
        started_at=wall(clock.start),
        seconds=clock.end - clock.start,
        ranks=tuple(r.trace for r in sorted(reports, key=lambda r: r.rank)),
        phases=(("pause", wall(clock.start), wall(clock.paused)),
                ("transfer", wall(clock.paused), wall(clock.transferred)),
                ("resume", wall(clock.transferred), wall(clock.end))),
        nic_bound_seconds=nic_bound_seconds(
            summary.send_nic_bytes, summary.recv_nic_bytes,
            send_bytes_per_s=send_bytes_per_s, recv_bytes_per_s=recv_bytes_per_s),
        transfer_started_at=wall(clock.paused),
    )
