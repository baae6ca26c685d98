"""The completion fence: a replica flips (shadow mode) or resumes (in place) only after
every WRITE of the version into it completed at its writer and the controller saw it.

A trainer rank's report (``RankReport.transfer.dest_bytes``) counts, per engine
rank, the bytes of the WRITEs that *completed* (the transport's ``write``
returned: on RDMA, the work completion was polled). The plan says how many bytes
each trainer rank writes into each engine rank (``PlanSummary.dest_bytes_by_rank``).
A replica is cleared when, for every trainer rank that writes into it, the
controller holds that rank's report and its completed bytes equal the planned
bytes for every engine rank of the replica::

    fence = completion_fence(summary.dest_bytes_by_rank, reports, replicas=["engine0"])
    fence.cleared                       # ("engine0",) once every write completed and was seen
    fence.pending["engine1"]            # "trainer rank 2: 0 of 4096 B into engine1/tp0 ..."

prime-rl's push design hit the race this closes: writes landing after the engine
resumed, and a "ready" marker sent before the writes completed. The fence does
not trust arrival order, a marker or a barrier: only completed bytes that the
controller holds in a report. (On a GPU target the engine rank then flushes
GPUDirect RDMA writes before its kernels read them:
:mod:`weight_transfer.engines.gpu_flush`.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weight_transfer.types import EngineRankId


@dataclass(frozen=True, slots=True, kw_only=True)
class FenceResult:
    """Replicas cleared to flip or resume, and why each other one is not."""

    cleared: tuple[str, ...]
    pending: dict[str, str] = field(default_factory=dict, hash=False)


def completion_fence(planned: Mapping[int, Mapping[str, Mapping[int, int]]],
                     reports: Mapping[int, Any], *, replicas: Sequence[str]) -> FenceResult:
    """``planned``: trainer rank -> replica -> engine rank -> bytes the plan writes;
    ``reports``: trainer rank -> the report the controller received (its
    ``transfer.dest_bytes``: completed bytes per ``"engine0/tp1"``)."""
    cleared, pending = [], {}
    for name in replicas:
        why = []
        for trainer, by_replica in sorted(planned.items()):
            ranks = by_replica.get(name)
            if not ranks:
                continue
            report = reports.get(trainer)
            if report is None:
                why.append(f"trainer rank {trainer}: no report seen")
                continue
            done = report.transfer.dest_bytes
            for rank, nbytes in sorted(ranks.items()):
                key = str(EngineRankId(replica=name, rank=rank))
                got = int(done.get(key, 0))
                if got != nbytes:
                    why.append(f"trainer rank {trainer}: {got} of {nbytes} B into {key} "
                               "completed")
        if why:
            pending[name] = "; ".join(why)
        else:
            cleared.append(name)
    return FenceResult(cleared=tuple(cleared), pending=pending)
