"""What trainers and the controller report about one weight update (plain data).

Every trainer rank turns its executor's
:class:`~weight_transfer.sender.executor.TransferReport` into a :class:`RankReport`
before it crosses the object store: the executor's report without its spans,
plus per-stage busy times, the failed writes and wall-clock times, so the
report of a rank has the same size for a 1 MB and a 1 TB model (unless the
update was traced: then ``RankReport.trace`` holds the rank's spans and
``UpdateReport.trace`` the whole update's, see :mod:`weight_transfer.observe.trace`). The controller
folds the ranks' reports into one :class:`UpdateReport`::

    rank_report = rank_report_of(transfer_report, failures=..., started_at=..., finished_at=...)
    rank_report.transfer.bytes_written   # the executor's numbers, written once
    report = UpdateReport.combine(version=7, seconds=1.2, per_rank=[...], ...)
    report.stages        # {"h2d": s, "prepare": s, "write": s, "barrier": s}, max over ranks
    report.gb_per_s      # bytes / seconds / 1e9

A stage's busy time on one rank is the length of the union of its spans (four
writes in flight for one second count one second, not four).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weight_transfer.errors import FaultKind

if TYPE_CHECKING:  # the executor imports torch, the check Ray; this module stays light
    from actors.controller.checks import IntegrityResult
    from weight_transfer.observe.trace import RankTrace, UpdateTrace
    from weight_transfer.sender.executor import TransferReport

STAGES: tuple[str, ...] = ("h2d", "prepare", "write", "barrier")


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteFailure:
    """Writes of one trainer rank into one replica that failed (first error kept)."""

    replica: str
    owner: str
    count: int
    nbytes: int
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerFault:
    """One trainer rank that did not report on an update: ``kind`` FAILED (it raised:
    ``error`` is the remote error's first line), TIMEOUT (it did not finish in time) or
    ABORTED (the controller stopped waiting when another rank failed); ``cause``: the
    remote error itself where Ray carried it (a ``BarrierRefusedError`` is audited)."""

    rank: int
    kind: FaultKind
    error: str
    cause: BaseException | None = field(default=None, compare=False, repr=False)  # typed


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """One trainer rank's part of one update; constant size, whatever the model.

    ``transfer`` is the executor's report with its spans dropped (they are
    summed into ``stages``); its ``bytes_written`` and ``writes`` count only
    the writes that landed.
    """

    transfer: TransferReport
    stages: dict[str, float] = field(default_factory=dict, hash=False)
    started_at: float = 0.0  # time.time() when the rank got "go"
    finished_at: float = 0.0  # time.time() after its last write and barrier
    failures: tuple[WriteFailure, ...] = ()
    trace: RankTrace | None = field(default=None, hash=False, repr=False)  # only when asked

    @property
    def rank(self) -> int:
        return self.transfer.rank

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failed_replicas(self) -> tuple[str, ...]:
        return tuple(sorted({f.replica for f in self.failures}))


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ends before it starts: ({start}, {end})")
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def stage_seconds(spans: Iterable[Any], barrier_seconds: float = 0.0) -> dict[str, float]:
    """Busy seconds per stage of one rank's spans (objects with stage, start, end)."""
    by_stage: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        by_stage.setdefault(s.stage, []).append((s.start, s.end))
    out = {stage: busy_seconds(iv) for stage, iv in by_stage.items()}
    out["barrier"] = float(barrier_seconds)
    return {stage: out.get(stage, 0.0) for stage in (*STAGES, *sorted(set(out) - set(STAGES)))}


def rank_report_of(
    transfer: TransferReport,
    *,
    failures: Sequence[WriteFailure] = (),
    started_at: float = 0.0,
    finished_at: float = 0.0,
    trace: RankTrace | None = None,
) -> RankReport:
    """Compact a TransferReport: stage busy times instead of spans (``trace``, the spans of
    a traced update, is kept only when given)."""
    return RankReport(
        transfer=dataclasses.replace(transfer, spans=(), task_spans=(), barrier_spans=()),
        trace=trace,
        stages=stage_seconds(transfer.spans, transfer.barrier_seconds),
        started_at=started_at,
        finished_at=finished_at,
        failures=tuple(failures),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReport:
    """One update as the controller saw it.

    ``seconds`` is the controller's wall time (pause, transfer, resume);
    ``transfer_seconds`` the slowest rank's step; ``stages`` the slowest rank's
    busy time per stage and ``stages_summed`` the sum over ranks;
    ``control_bytes`` the pickled size of every Ray call argument and result
    the update exchanged (the object store's share of the update);
    ``integrity`` what the checksum check compared (an
    :class:`~actors.controller.checks.IntegrityResult`: mode, ranges, bytes,
    seconds, ok; ``as_dict()`` gives it as JSON); ``retries`` the WRITEs retried.
    """

    version: int
    seconds: float
    bytes: int
    stages: dict[str, float] = field(hash=False)
    stages_summed: dict[str, float] = field(hash=False)
    transfer_seconds: float
    pause_seconds: float = 0.0
    resume_seconds: float = 0.0
    control_bytes: int = 0
    control_calls: int = 0
    replicas: tuple[str, ...] = ()
    per_rank: tuple[RankReport, ...] = ()
    trace: UpdateTrace | None = field(default=None, hash=False, repr=False)  # update(trace=)
    integrity: IntegrityResult | None = field(default=None, hash=False)  # the checksum check
    # the controller's wall and process CPU per step of the update (directive, begin,
    # transfer, fence, apply, groups, check, end): {"transfer": {"wall": s, "cpu": s}, ...}
    phases: dict[str, dict[str, float]] = field(default_factory=dict, hash=False)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def sources(self) -> dict[int, str]:
        """What each trainer rank wrote from: ``zero_copy`` or ``snapshot`` (the transfer
        config's ``source``, decided per update)."""
        return {r.rank: r.transfer.source for r in self.per_rank}

    @property
    def zero_copy_bytes(self) -> int:
        """Bytes written straight from the trainers' registered parameters."""
        return sum(r.transfer.zero_copy_bytes for r in self.per_rank)

    @property
    def retries(self) -> int:
        """WRITEs the ranks tried again after a transient error (weight_transfer.sender.retry)."""
        return sum(r.transfer.retries for r in self.per_rank)

    @classmethod
    def combine(
        cls,
        *,
        version: int,
        seconds: float,
        per_rank: Sequence[RankReport],
        **extra: Any,
    ) -> UpdateReport:
        """Fold the ranks' reports (all of ``version``) into one."""
        if not per_rank:
            raise ValueError(f"update to version {version}: no rank reports to combine")
        wrong = [r.rank for r in per_rank if r.transfer.version != version]
        if wrong:
            raise ValueError(f"update to version {version}: ranks {wrong} report another version")
        names = sorted({s for r in per_rank for s in r.stages}, key=_stage_order)
        return cls(
            version=version,
            seconds=seconds,
            bytes=sum(r.transfer.bytes_written for r in per_rank),
            stages={s: max(r.stages.get(s, 0.0) for r in per_rank) for s in names},
            stages_summed={s: sum(r.stages.get(s, 0.0) for r in per_rank) for s in names},
            transfer_seconds=max(r.transfer.seconds for r in per_rank),
            per_rank=tuple(sorted(per_rank, key=lambda r: r.rank)),
            **extra,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (per-rank numbers included, failures as strings)."""
        return {
            "version": self.version,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "gb_per_s": self.gb_per_s,
            "transfer_seconds": self.transfer_seconds,
            "pause_seconds": self.pause_seconds,
            "resume_seconds": self.resume_seconds,
            "stages": dict(self.stages),
            "stages_summed": dict(self.stages_summed),
            "control_bytes": self.control_bytes,
            "control_calls": self.control_calls,
            "replicas": list(self.replicas),
            "retries": self.retries,
            "integrity": None if self.integrity is None else self.integrity.as_dict(),
            "phases": {k: dict(v) for k, v in self.phases.items()},
            "per_rank": [
                {"rank": r.rank, "seconds": r.transfer.seconds,
                 "bytes": r.transfer.bytes_written, "writes": r.transfer.writes,
                 "stages": dict(r.stages)}
                for r in self.per_rank
            ],
        }


def _stage_order(stage: str) -> tuple[int, str]:
    return (STAGES.index(stage) if stage in STAGES else len(STAGES), stage)
