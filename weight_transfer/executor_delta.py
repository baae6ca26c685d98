"""How a rank's transfer wires in the delta stage: record WRITEs and dense re-sends.

:class:`~weight_transfer.executor.RankTransfer` keeps its delta entry points
(``attach_delta``, ``delta_tasks`` and the ``record`` callback it hands
:meth:`weight_transfer.delta_write.DeltaStage.write`) as thin methods over these
functions, so the executor holds no delta bookkeeping of its own:

* :func:`write_record` writes one task's delta record into its engine rank's
  arena and counts it as landed with the piece's own bytes (the report, the
  integrity check and the engine bytes see the piece, not its encoding);
* :func:`tasks_for_resend` picks the rank's tasks into given engine ranks or onto
  given ranges, those an engine asks to have re-sent dense::

    await write_record(run, where, buf, task, integrity=policy, on_write_error=None,
                       spans=task_spans)
    tasks = tasks_for_resend(groups, owners={"engine0/tp1"}, ranges=set())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from weight_transfer.delta_write import Where
from weight_transfer.integrity import IntegrityPolicy
from weight_transfer.pipeline import Span
from weight_transfer.plan_check import GroupWork
from weight_transfer.run_log import RunLog
from weight_transfer.transport.base import TransportError
from weight_transfer.types import WriteTask


async def write_record(run: RunLog, where: Where, buf: torch.Tensor, task: WriteTask, *,
                       integrity: IntegrityPolicy,
                       on_write_error: Callable[[WriteTask, TransportError], None] | None,
                       spans: list[Span]) -> None:
    """A task's delta record ``where`` into its engine rank's arena; it lands (for the
    report, the integrity check and the engine bytes counted) as the piece's bytes ``buf``.
    A failed WRITE goes to ``on_write_error``, or is raised when there is none."""
    start = time.perf_counter()
    src, region, offset = where
    try:
        await run.writer.write(src, region, offset)
    except TransportError as exc:
        if on_write_error is None:
            raise
        on_write_error(task, exc)
        return
    run.landed(task, buf, integrity)
    spans.append(Span(key=task.task_id, stage="write", start=start,
                      end=time.perf_counter(), nbytes=src.numel()))


def tasks_for_resend(groups: Sequence[GroupWork], owners: set[str],
                     ranges: set[tuple[int, int, int]]) -> list[WriteTask]:
    """The tasks of ``groups`` into engine ranks ``owners`` (all of them) or onto
    ``ranges`` ((region addr, offset, nbytes)): those to re-send dense."""
    return [t for g in groups for ts in g.tasks.values() for t in ts
            if t.region.owner in owners
            or (t.region.addr, t.region_offset, t.nbytes) in ranges]
