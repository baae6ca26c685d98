"""The write stage of a delta update: encode a bucket's pieces, place each task's record in
its engine rank's slot (or write the piece dense), and write the records in batches.

:class:`~weight_transfer.sender.executor.RankTransfer` hands a bucket's prepared
``(bytes, task)`` pairs here when a :class:`~weight_transfer.sender.delta.send.DeltaSender`
is attached (``transfer.attach_delta(sender)``); the bytes are whatever the
prepare stage produced (a gather or the rank's own shard), so deltas do not
depend on how pieces are made. The executor encodes a bucket on its prepare
thread right after the bucket's prepare (:meth:`DeltaStage.encode_pairs`): a
second thread hand-off per bucket (hundreds per update, each a wake-up and a
GIL switch on a loaded CPU) cost more than the overlap won; a caller without
it has them encoded on a thread of the stage's own. Dense WRITEs then run
concurrently as usual. Records placed back to
back in one engine rank's slot go out as one WRITE
(:class:`~weight_transfer.sender.delta.send.RecordRun`) once :data:`FLUSH_BYTES` of them
wait, the rest after the last bucket: a WRITE per record (hundreds of a few
hundred bytes per update) cost more than their bytes. Then
:meth:`DeltaStage.headers` writes every slot header (the engine reads a slot
only through its header, so a header lands after its records). The
intervals of the dense writes give the rank's dense write rate
(:meth:`~weight_transfer.sender.delta.send.DeltaSender.measured`, the time rule's
``r_nic``)::

FP8 pieces are prepared here too (:meth:`DeltaStage.prepare_into`, in the
prepare stage): where the sender keeps the source rectangle, only its changed
elements are quantized (:mod:`weight_transfer.sender.delta.source`), else the pair is
quantized whole as usual and its source kept for the next update::

    stage = DeltaStage(sender)
    sources = stage.prepare_into(full, pieces, rects_of, outs, views=False)
    await stage.write(pairs, dense=write_task, known=piece_sum, records=write_records)
    await stage.headers(write, records=write_records)     # at the end of the run
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from weight_transfer.delta.policy import busy_seconds
from weight_transfer.observe.phases import ThreadTimer
from weight_transfer.sender.delta.send import DeltaDirective, DeltaSender, Encoded, RecordRun
from weight_transfer.sender.prepare import prepare_pieces_into, source_rect
from weight_transfer.types import Piece, RegionDesc, Transform, WriteTask

DenseWrite = Callable[[torch.Tensor, WriteTask], Awaitable[None]]
Known = Callable[[WriteTask, int], None]  # a task's piece bytes' XXH3-64, known after encode
RecordsWrite = Callable[[RecordRun], Awaitable[None]]
# An engine rank's records are written as soon as this many bytes of them wait (so a large
# delta still overlaps its encoding), the rest after the last bucket.
FLUSH_BYTES = 4 << 20


class DeltaStage:
    """See the module docstring."""

    def __init__(self, sender: DeltaSender) -> None:
        self.sender = sender
        self.active = False  # between begin() and the end of the run
        self._dense: list[tuple[float, float]] = []  # this run's dense writes in flight
        self._dense_bytes = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"wt-delta-{sender.rank}")

    def begin(self, directive: DeltaDirective) -> None:
        self.sender.begin(directive)
        self.active = True
        self._dense, self._dense_bytes = [], 0

    def prepare_into(self, full: torch.Tensor, pieces: Sequence[Piece],
                     srcs: Sequence[Piece], outs: Sequence[torch.Tensor], *,
                     views: bool = False) -> list[torch.Tensor]:
        """:func:`~weight_transfer.sender.prepare.prepare_pieces_into` of ``pieces`` (``srcs``: the
        same pieces with sources relative to ``full``), an FP8 pair's bytes from its
        source's changes where the sender can (copied into their ``outs``; with ``views``,
        a NIC that writes from any host memory, the sender's kept bytes themselves)."""
        ready: dict[int, torch.Tensor] = {}
        pairs: dict[tuple, dict[Transform, int]] = {}
        for i, p in enumerate(pieces):
            if p.transform in (Transform.FP8_WEIGHT, Transform.FP8_SCALE):
                pairs.setdefault(srcs[i].src_slice, {})[p.transform] = i
        kept = []
        for pair in pairs.values():
            w, sc = pair.get(Transform.FP8_WEIGHT), pair.get(Transform.FP8_SCALE)
            if w is None or sc is None:
                continue
            rect = source_rect(full, srcs[w]).detach()
            if self.sender.prepare_fp8(pieces[w], pieces[sc], rect):
                for i in (w, sc):  # the kept bytes are this update's now
                    data = self.sender.base[pieces[i]].data
                    if views:  # a NIC that writes from any host memory: sent from there
                        ready[i] = torch.from_numpy(data)
                    else:
                        outs[i].numpy()[:] = data
                        ready[i] = outs[i]
            else:
                kept.append((pieces[w], rect))
        rest = [i for i in range(len(pieces)) if i not in ready]
        if rest:
            got = prepare_pieces_into(full, [srcs[i] for i in rest], [outs[i] for i in rest],
                                      views=views)
            ready.update(zip(rest, got, strict=True))
        for weight, rect in kept:  # quantized whole: the source kept for the next update
            self.sender.keep_fp8_source(weight, rect)
        return [ready[i] for i in range(len(pieces))]

    def encode_pairs(self, pairs: Sequence[tuple[torch.Tensor, WriteTask]]
                     ) -> dict[Piece, Encoded]:
        """Encode the pieces of a bucket's ``(bytes, task)`` pairs now, on the calling thread
        (the prepare stage's: one thread hand-off per bucket, not two); their result goes
        to :meth:`write` as ``encoded``."""
        return self._encode({t.piece: buf for buf, t in pairs})

    def _encode(self, pieces: dict[Piece, torch.Tensor]) -> dict[Piece, Encoded]:
        timer = ThreadTimer()
        with timer:
            out = {p: self.sender.encode(p, buf) for p, buf in pieces.items()}
        st = self.sender.stats
        st.encode_thread_s += timer.wall
        st.encode_thread_cpu_s += timer.cpu
        return out

    async def write(self, pairs: Sequence[tuple[torch.Tensor, WriteTask]], *,
                    dense: DenseWrite, known: Known, records: RecordsWrite,
                    encoded: dict[Piece, Encoded] | None = None) -> None:
        """Encode ``pairs``' pieces on the encoding thread (unless ``encoded``: done by
        :meth:`encode_pairs`) (``known(task, digest)``: the XXH3-64 of the piece's
        bytes, the sender's digest of the bytes it now keeps); write each task dense or
        place its record; write the records of engine ranks with :data:`FLUSH_BYTES`
        waiting."""
        enc = encoded
        if enc is None:
            pieces = {t.piece: buf for buf, t in pairs}
            loop = asyncio.get_running_loop()
            enc = await loop.run_in_executor(self._pool, self._encode, pieces)
        jobs = []
        for buf, task in pairs:
            known(task, self.sender.base[task.piece].digest)
            if self.sender.place(task, enc[task.piece]) is None:
                jobs.append(self._timed(dense(buf, task), task.nbytes))
        jobs += [records(run) for run in self.sender.take(min_bytes=FLUSH_BYTES)]
        await asyncio.gather(*jobs)

    async def _timed(self, job: Awaitable[None], nbytes: int) -> None:
        start = time.perf_counter()
        await job
        self._dense.append((start, time.perf_counter()))
        self._dense_bytes += nbytes

    async def headers(self, write: Callable[[torch.Tensor, RegionDesc, int], Awaitable[None]],
                      *, records: RecordsWrite) -> None:
        """The records still waiting, then every slot header (after its records landed)."""
        try:
            await asyncio.gather(*(records(run) for run in self.sender.take()))
            await asyncio.gather(*(write(src, region, off)
                                   for src, region, off in self.sender.finish()))
            self.sender.measured(self._dense_bytes, busy_seconds(self._dense))
        finally:
            self.active = False

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.sender.close()
