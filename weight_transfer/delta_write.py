"""The write stage of a delta update: encode a bucket's pieces, then write each task's
record into its engine rank's arena, or the piece dense.

:class:`~weight_transfer.executor.RankTransfer` hands a bucket's prepared
``(bytes, task)`` pairs here when a :class:`~weight_transfer.delta_send.DeltaSender`
is attached (``transfer.attach_delta(sender)``); the bytes are whatever the
prepare stage produced (a gather or the rank's own shard), so deltas do not
depend on how pieces are made. Encoding runs on one thread of its own (numpy
releases the GIL in the diff and the scatter), so the next bucket's gather
overlaps it; the WRITEs then run concurrently as dense ones do. After the last
bucket, :meth:`DeltaStage.headers` writes every slot header (the engine reads a
slot only through its header, so a header lands after its records)::

    stage = DeltaStage(sender)
    await stage.write(pairs, dense=write_task, record=write_record)
    await stage.headers(write)          # at the end of the run
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from weight_transfer.delta_send import DeltaDirective, DeltaSender, Encoded
from weight_transfer.types import Piece, RegionDesc, WriteTask

Where = tuple[torch.Tensor, RegionDesc, int]
DenseWrite = Callable[[torch.Tensor, WriteTask], Awaitable[None]]
RecordWrite = Callable[[Where, torch.Tensor, WriteTask], Awaitable[None]]


class DeltaStage:
    """See the module docstring."""

    def __init__(self, sender: DeltaSender) -> None:
        self.sender = sender
        self.active = False  # between begin() and the end of the run
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"wt-delta-{sender.rank}")

    def begin(self, directive: DeltaDirective) -> None:
        self.sender.begin(directive)
        self.active = True

    def _encode(self, pieces: dict[Piece, torch.Tensor]) -> dict[Piece, Encoded]:
        return {p: self.sender.encode(p, buf) for p, buf in pieces.items()}

    async def write(self, pairs: Sequence[tuple[torch.Tensor, WriteTask]], *,
                    dense: DenseWrite, record: RecordWrite) -> None:
        pieces = {t.piece: buf for buf, t in pairs}
        loop = asyncio.get_running_loop()
        enc = await loop.run_in_executor(self._pool, self._encode, pieces)
        jobs = []
        for buf, task in pairs:
            where = self.sender.place(task, enc[task.piece])
            jobs.append(dense(buf, task) if where is None else record(where, buf, task))
        await asyncio.gather(*jobs)

    async def headers(self, write: Callable[[torch.Tensor, RegionDesc, int], Awaitable[None]]
                      ) -> None:
        try:
            await asyncio.gather(*(write(src, region, off)
                                   for src, region, off in self.sender.finish()))
        finally:
            self.active = False

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.sender.close()
