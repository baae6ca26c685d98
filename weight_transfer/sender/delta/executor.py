"""How a rank's transfer wires in the delta stage: batched record WRITEs and dense re-sends.

:class:`~weight_transfer.sender.executor.RankTransfer` keeps its delta entry points
(``attach_delta``, ``delta_tasks`` and the ``known`` and ``records`` callbacks it hands
:meth:`weight_transfer.sender.delta.write.DeltaStage.write`) as thin methods over these
functions, so the executor holds no delta bookkeeping of its own:

* :func:`write_records` writes a run of delta records (those placed back to back
  in one engine rank's slot, :class:`~weight_transfer.sender.delta.send.RecordRun`) in
  one WRITE and counts each task as landed with its piece's own bytes, whose
  checksum the encode gave (the report, the integrity check and the engine bytes
  see the piece, not its encoding);
* :func:`tasks_for_resend` picks the rank's tasks into given engine ranks or onto
  given ranges, those an engine asks to have re-sent dense::

    run.hash_piece(task, None, policy, value=digest)   # the encode's digest of the piece
    await write_records(run, records, integrity=policy, on_write_error=None,
                        spans=task_spans)
    tasks = tasks_for_resend(groups, owners={"engine0/tp1"}, ranges=set())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from weight_transfer.integrity.checksums import IntegrityPolicy
from weight_transfer.plan.check import GroupWork
from weight_transfer.sender.delta.send import RecordRun
from weight_transfer.sender.pipeline import Span
from weight_transfer.sender.run_log import RunLog
from weight_transfer.transport.base import TransportError
from weight_transfer.types import WriteTask


async def write_records(run: RunLog, records: RecordRun, *, integrity: IntegrityPolicy,
                        on_write_error: Callable[[WriteTask, TransportError], None] | None,
                        spans: list[Span]) -> None:
    """One WRITE of ``records`` into its engine rank's arena; each of its tasks then lands
    (its piece's checksum given to ``run.hash_piece`` before). A failed WRITE goes to
    ``on_write_error`` for each task, or is raised when there is none."""
    start = time.perf_counter()
    try:
        await run.writer.write(records.src, records.region, records.offset)
    except TransportError as exc:
        if on_write_error is None:
            raise
        for task in records.tasks:
            on_write_error(task, exc)
        return
    for task in records.tasks:
        run.landed(task, None, integrity)
    spans.append(Span(key=records.tasks[0].task_id, stage="write", start=start,
                      end=time.perf_counter(), nbytes=records.src.numel()))


def tasks_for_resend(groups: Sequence[GroupWork], owners: set[str],
                     ranges: set[tuple[int, int, int]]) -> list[WriteTask]:
    """The tasks of ``groups`` into engine ranks ``owners`` (all of them) or onto
    ``ranges`` ((region addr, offset, nbytes)): those to re-send dense."""
    return [t for g in groups for ts in g.tasks.values() for t in ts
            if t.region.owner in owners
            or (t.region.addr, t.region_offset, t.nbytes) in ranges]
