"""What the controller exports about each update: metrics, a trace, progress of waits.

The controller calls these after an update (plain functions over its reports,
so they are tested without Ray)::

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from actors.messages import PlanSummary
from actors.reports import RankReport, TrainerFault, UpdateReport
from weight_transfer.errors import FaultKind
from weight_transfer.observe.metrics import TransferMetrics
from weight_transfer.observe.trace import UpdateTrace, nic_bound_seconds

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
