"""How an update ended, shared by the in-place steps (:mod:`actors.controller.update`) and
the shadow-mode steps (:mod:`actors.controller.shadow`): the outcome, its audit line, the
deadline shares, the refused barrier arrivals, and merging fault tables."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from actors.controller.audit import RefusedAudit, UpdateAudit
from actors.controller.checks import IntegrityResult
from actors.controller.engine_control import RankFault
from actors.reports import RankReport, TrainerFault, UpdateReport
from weight_transfer.engines.rank import EngineRank, method_name
from weight_transfer.errors import BarrierRefusedError, UpdateError

PAUSE_SHARE = 0.25  # of update_timeout_s: the most the pause may take
RESUME_SHARE = 0.1  # of update_timeout_s: kept for the resume when the transfer overruns


@dataclass(frozen=True, slots=True, kw_only=True)
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


def merge_faults(into: dict[str, list[RankFault]], more: Mapping[str, list[RankFault]]) -> None:
    for name, faults in more.items():
        into.setdefault(name, []).extend(faults)


def check_faults(check: IntegrityResult) -> dict[str, list[RankFault]]:
    """The engine ranks that could not be checked (no answer, died, failed) as faults of
    their replicas, so they are held like ranks that missed a pause or a resume."""
    out: dict[str, list[RankFault]] = {}
    for m in check.mismatches:
        if m.actual is not None or any(f.rank == m.rank for f in out.get(m.replica, ())):
            continue
        out.setdefault(m.replica, []).append(RankFault(
            replica=m.replica, rank=m.rank, kind=m.fault,
            method=method_name(EngineRank.wt_checksum), error=m.error))
    return out
