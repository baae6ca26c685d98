"""One trainer rank's part of a weight transfer: its tasks through the stage pipeline.

The unit that flows through the pipeline is one *gather bucket*
(:mod:`weight_transfer.sender.gather`), not one task, because gathering is a
collective: every rank of a parameter's mesh must gather it, in the same
order, whether or not it writes any of it. ``gather_unit="bucket"`` (the default)
gathers runs of consecutive parameters with one mesh and one placement tuple
of ``Shard``/``Replicate`` (FSDP2's ``(Shard(0),)``, HSDP, EP x FSDP stacked
experts; at most ``bucket_bytes``) with one collective per sharded mesh dim,
and every other parameter alone with ``full_tensor()``; ``gather_unit="param"``
gathers each parameter alone, as ``full_tensor()`` does. (``TransferConfig.gather``,
``shard_direct`` or ``full``, is another choice: which parameters the plan gathers at
all.) The
rank's part of the plan (``weight_transfer.plan.types.TrainerPlan``: per mesh group, the
parameters to gather in the mesh's order and the rank's write tasks) is
replayed as it is, for each mesh group in order:

1. the group's parameters are taken in the plan's gather order;
2. the group's parameters are cut into the same buckets on every rank of a
   mesh; each bucket reserves its temporary bytes (gather buffers and full
   tensors, :func:`weight_transfer.sender.gather.reserve_bytes`, + prepared pieces)
   from the watermark, then passes the stages
   ``h2d`` (local shards to the compute device, when FSDP keeps them on the host),
   ``prepare`` (one gather, then every piece this rank writes from its
   parameters: fusion parts, TP/EP slices, FP8 quantization),
   ``write`` (one-sided WRITEs of those pieces, concurrently);
3. after the group's last parameter, a barrier over all trainer ranks.

Shard-direct parameters (the group's ``local``, :mod:`scheduling.build.direct`)
come first, each an item of its own with no collective: ``prepare`` cuts
(and casts or quantizes) the rank's pieces from its own block of the
parameter, so the same bytes land as from the gathered tensor; their watermark
reservation is the prepared pieces alone. The prepare stage itself (gather or
own block, then the pieces) is :mod:`weight_transfer.sender.bucket_prepare`.

Staging (``staging=True``, the default): the prepared pieces are written into
a :class:`~weight_transfer.sender.staging.StagingArena` allocated, pre-faulted and
registered with the transport once, when the transfer is built, and the
WRITEs read from it; an update allocates and registers nothing. Zero-copy
(``source``, :mod:`weight_transfer.sender.zero_copy.sources`): a shard-direct piece whose
bytes already lie in order in the rank's registered parameter memory is written from
there, not staged, while the trainer's step is fenced off (``fence``); each report says
which source the update used (``source``, ``zero_copy_bytes``, ``sources_refused``). The arena
holds ``min(watermark_bytes, the most prepared bytes one mesh group needs)``.
It sits on the GPU when the transport reads device memory
(``transport.supports_device_memory``: rdma with CUDA dma-buf) and the
parameters are there, so pieces never leave the GPU; otherwise in host memory.
A transport that reads any host memory (simnic, tcp) writes a piece that
already is a contiguous slice of a gathered tensor in its dtype straight from it
(not in a ``snapshot`` update); only pieces that must be cut,
cast or quantized go through the arena. ``staging=False`` allocates every
materialized piece afresh (the baseline of ``wt bench staging``).

Every WRITE goes through a :class:`~weight_transfer.sender.retry.RetryingWriter`:
under ``retry`` (a :class:`~weight_transfer.sender.retry.RetryPolicy`; default
``RetryPolicy()``, 4 tries) a transient error (link down) is retried, counted in the report's
``retries``. Under ``integrity`` (an
:class:`~weight_transfer.integrity.checksums.IntegrityPolicy`; default ``IntegrityPolicy()``,
a tenth of the WRITEs; ``IntegrityPolicy(mode="off")`` hashes none) the exact
source bytes of every selected WRITE that landed are hashed; the report's
``checksums`` hold them per engine rank, for the controller to compare with
what the engine holds. ``dest_bytes`` counts landed bytes per engine rank.

A WRITE that fails with a :class:`~weight_transfer.transport.base.TransportError`
(after its retries) aborts the run, unless ``on_write_error`` is given: then the failed task is
handed to it and the rank goes on gathering and joining barriers (the other
ranks of its meshes wait for it in every ``full_tensor()``). The report's
``bytes_written`` and ``writes`` count only the WRITEs that completed;
``bytes_planned`` is what the plan asked for. Given ``metrics`` (a
:class:`~weight_transfer.observe.metrics.TransferMetrics`), the rank records the
watermark bytes it holds as they change, its NIC's bytes and GB/s after each
run, and each failed WRITE by error class. With a
:class:`~weight_transfer.sender.delta.write.DeltaStage` attached (``attach_delta``), the
write stage sends sparse deltas instead; its wiring (batched record WRITEs, the tasks to
re-send dense) is :mod:`weight_transfer.sender.delta.executor`.

Usage (the Ray actor is a thin shell around this)::

    transfer = RankTransfer(plan=plan.trainer_plan(r), params=trainer_meta.params,
                            get_param=model_params.__getitem__, transport=nic,
                            barrier=barrier, watermark_bytes=2 << 30)
    report = await transfer.run(version=7)   # a TransferReport
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weight_transfer.integrity.checksums import IntegrityPolicy
from weight_transfer.observe.metrics import TransferMetrics
from weight_transfer.observe.phases import ThreadTimer
from weight_transfer.plan.check import GroupWork, check_trainer_plan
from weight_transfer.plan.types import TrainerPlan
from weight_transfer.sender.bucket_prepare import (
    BucketWork,
    bucket_items,
    prepare_bucket,
    to_device,
)
from weight_transfer.sender.delta.executor import tasks_for_resend, write_records
from weight_transfer.sender.delta.send import RecordRun
from weight_transfer.sender.delta.write import DeltaStage
from weight_transfer.sender.gather import DEFAULT_BUCKET_BYTES, GatherBucket
from weight_transfer.sender.pipeline import Pipeline, PipelineItem, Span, Stage
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.sender.rank_items import (
    BucketLayout,
    group_layouts,
    own_block,
    zero_copy_pieces,
)
from weight_transfer.sender.retry import RetryingWriter, RetryPolicy
from weight_transfer.sender.run_log import RunLog, TransferReport
from weight_transfer.sender.staging import rank_arena
from weight_transfer.sender.watermark import ByteWatermark, WatermarkGauge
from weight_transfer.sender.zero_copy.fence import StepFence
from weight_transfer.sender.zero_copy.sources import SourcePolicy, UpdateSources, local_tensor
from weight_transfer.transport.base import TransportError
from weight_transfer.types import ParamMeta, WriteTask

log = logging.getLogger(__name__)

__all__ = ["GroupWork", "RankTransfer", "TransferReport", "check_trainer_plan", "own_block",
           "to_device"]


WriteErrorHook = Callable[[WriteTask, TransportError], None]


class RankTransfer:
    """One rank's part of a weight transfer, run once per version; see the module docstring."""

    def __init__(
        self,
        *,
        plan: TrainerPlan,
        params: Sequence[ParamMeta],
        get_param: Callable[[str], Any],
        transport: Any,
        barrier: Any = None,
        watermark_bytes: int = 1 << 30,
        device: torch.device | str | None = None,
        write_concurrency: int = 4,
        serial: bool = False,
        on_write_error: WriteErrorHook | None = None,
        metrics: TransferMetrics | None = None,
        staging: bool = True,
        gather_unit: str = "bucket",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        record_collectives: bool = False,
        integrity: IntegrityPolicy = IntegrityPolicy(),
        retry: RetryPolicy = RetryPolicy(),
        gather: str | None = None,
        source: str = "auto",
        fence: StepFence | None = None,
        fence_timeout_s: float | None = None,
    ) -> None:
        if gather is not None:  # the 0.1.0 name (TransferConfig.gather means another thing)
            warnings.warn("RankTransfer(gather=...) is deprecated: write "
                          f"RankTransfer(gather_unit={gather!r})", DeprecationWarning,
                          stacklevel=2)
            gather_unit = gather
        self.rank = plan.rank
        self.groups = check_trainer_plan(plan, params)
        # Same on every rank of a mesh: a function of the plan and the metadata only.
        # A bucket's gather holds at most a quarter of the watermark, so that buckets
        # still overlap in the pipeline (both values are the same on every rank).
        self.bucket_bytes = max(1, min(bucket_bytes, watermark_bytes // 4))
        self.layouts = [group_layouts(g, gather_unit=gather_unit, bucket_bytes=self.bucket_bytes)
                        for g in self.groups]
        self.bytes_planned = sum(lay.nbytes for group in self.layouts for lay in group)
        self.gather_unit = gather_unit
        # Every collective this rank issued in the last run, in order (tests of the contract).
        self.collectives: list[tuple] | None = [] if record_collectives else None
        self.get_param = get_param
        self.transport = transport
        self.barrier = barrier
        self.watermark_bytes = watermark_bytes
        self.device = torch.device(device) if device is not None else None
        self.write_concurrency = write_concurrency
        self.serial = serial
        self.on_write_error = on_write_error
        self.metrics = metrics
        self.integrity = integrity
        self.retry = retry
        self._task_spans: list[Span] = []
        self._watermark_changed = WatermarkGauge(metrics, rank=self.rank)
        self._run = RunLog(version=0, writer=RetryingWriter(transport, self.retry))
        self.turns = 0  # runs started since this plan: the sample integrity mode's rotation
        # The NIC reads GPU memory (rdma with dma-buf): pieces stay on the GPU.
        self.device_memory = bool(transport.supports_device_memory)
        # A NIC that needs no source registration (simnic) writes a piece that already is a
        # contiguous slice of the gathered tensor straight from it: no copy at all.
        self.write_from_views = not transport.registers_sources
        self.arena = rank_arena(self.layouts, watermark_bytes=watermark_bytes,
                                device=self.device, device_memory=self.device_memory,
                                transport=transport, rank=self.rank) if staging else None
        self._init_sources(source, fence, staging=staging, timeout_s=fence_timeout_s)
        self.delta: DeltaStage | None = None  # sparse deltas (attach_delta), else dense
        # One thread for gathers: collectives must be issued in order, one at a time.
        self._gather_pool = ThreadPoolExecutor(1, thread_name_prefix=f"wt-gather-{self.rank}")

    @property
    def buckets(self) -> list[list[GatherBucket]]:
        """Per group, its items' buckets in order (a shard-direct parameter: one alone)."""
        return [[lay.bucket for lay in group] for group in self.layouts]

    def _init_sources(self, source: str, fence: StepFence | None, *, staging: bool,
                      timeout_s: float | None) -> None:
        """Zero-copy pieces (static; none with ``staging=False``, the baseline that allocates
        every piece afresh) and the per-update choice of source, with its fence (an update
        waits at most ``timeout_s`` for a step in flight: TimeoutError naming the rank)."""
        self.zero_copy = zero_copy_pieces(self.layouts, self.rank) if staging else {}
        self.sources = SourcePolicy(transport=self.transport, mode=source, fence=fence,
                                    device_memory=self.device_memory,
                                    label=f"trainer rank {self.rank}",
                                    fence_timeout_s=timeout_s)
        self._used = UpdateSources(mode="snapshot")
        self._prepared = self._zero_copy_bytes = self._num_items = 0
        self._prepare_timer = ThreadTimer()

    def register_sources(self) -> list[str]:
        """Register the memory the zero-copy pieces read from, once, at setup (else at the
        first run); ``get_param`` must answer for this rank's shard-direct parameters."""
        return self.sources.register({n: self.get_param(n) for n in self.zero_copy})

    def _items(self, layouts: list[BucketLayout]) -> list[PipelineItem]:
        """Fresh per-update work for each bucket of a group (the layouts are static)."""
        direct = {n: q for n, q in self.zero_copy.items() if n in self._used.params}
        return bucket_items(layouts, direct=direct, full_reserve=self.serial)

    async def _h2d(self, work: BucketWork) -> BucketWork:
        for p in work.params:
            local = self.get_param(p.meta.name)
            if self.device is not None and self.device.type == "cuda":
                local = await asyncio.to_thread(to_device, local, self.device)
            p.local = local
        return work

    def _gather_and_prepare(self, work: BucketWork) -> BucketWork:
        record = None if self.collectives is None else self.collectives.append
        delta = self.delta if self.delta is not None and self.delta.active else None
        # Without autograd: the trainer's parameters require grad, and grad mode is on in
        # this thread by default, so every cut and quantization built a graph that kept
        # its float32 temporaries (0.1 GB per plan and rank, never freed in a long run).
        for p in work.params:  # the source moved since the update began (or left for a GPU)
            if p.zero_copy and not self.sources.registry.usable(p.meta.name,
                                                                local_tensor(p.local)):
                p.zero_copy = frozenset()
        views = self.write_from_views and self._used.mode == "zero_copy"
        with torch.no_grad(), self._prepare_timer:
            work = prepare_bucket(work, rank=self.rank, write_from_views=views,
                                  record=record,
                                  prepare=None if delta is None else delta.prepare_into)
        if delta is not None:  # encoded on this thread too: no second hand-off per bucket
            work.encoded = delta.encode_pairs([(self._source(b), t)
                                               for b, t in self._pairs(work)])
        return work

    async def _prepare(self, work: BucketWork) -> BucketWork:
        if self.arena is not None:  # FIFO: this stage takes one bucket at a time, in order
            work.lease = await self.arena.acquire(work.layout.staged)
        loop = asyncio.get_running_loop()
        work = await loop.run_in_executor(self._gather_pool, self._gather_and_prepare, work)
        self._prepared += 1
        if self._used.mode == "snapshot" and self._prepared == self._num_items:
            self.sources.release()  # every source byte copied: the next step may run
        return work

    @staticmethod
    def _pairs(work: BucketWork) -> list[tuple[torch.Tensor, WriteTask]]:
        return [(buf, t) for p in work.params for buf, t in zip(p.prepared, p.tasks,
                                                                 strict=True)]

    async def _write(self, work: BucketWork) -> BucketWork:
        pairs = self._pairs(work)
        if self.delta is not None and self.delta.active:
            await self.delta.write([(self._source(b), t) for b, t in pairs],
                                   dense=self._write_task, known=self._piece_sum,
                                   records=self._write_records, encoded=work.encoded)
            work.encoded = None
        else:
            await asyncio.gather(*(self._write_task(buf, t) for buf, t in pairs))
        for p in work.params:
            self._zero_copy_bytes += sum(t.nbytes for t in p.tasks if t.piece in p.direct)
            p.prepared = []
        if self.arena is not None:
            self.arena.release(work.lease)
            work.lease = None
        return work

    async def _write_task(self, buf: torch.Tensor, task: WriteTask) -> None:
        start = time.perf_counter()
        src, run = self._source(buf), self._run
        try:
            await run.writer.write(src, task.region, task.region_offset)
        except TransportError as exc:
            if self.metrics is not None:  # by the fault's class (a retried one: its last)
                self.metrics.failure(type(exc.__cause__ or exc).__name__)
            if self.on_write_error is None:
                raise
            self.on_write_error(task, exc)
            return
        run.landed(task, src, self.integrity)
        self._task_spans.append(
            Span(key=task.task_id, stage="write", start=start, end=time.perf_counter(),
                 nbytes=task.nbytes)
        )

    def _piece_sum(self, task: WriteTask, value: int) -> None:
        """The checksum of a task's piece, known from its delta encode (no hashing again;
        a record lands batched, without its piece's bytes)."""
        self._run.hash_piece(task, None, self.integrity, value=value)

    async def _write_records(self, records: RecordRun) -> None:
        """Delta records, batched (:func:`weight_transfer.sender.delta.executor.write_records`)."""
        await write_records(self._run, records, integrity=self.integrity,
                            on_write_error=self.on_write_error, spans=self._task_spans)

    def attach_delta(self, stage: DeltaStage | None) -> None:
        """Write sparse deltas from the next run begun with a directive (None: dense)."""
        if self.delta is not None and self.delta is not stage:
            self.delta.close()
        self.delta = stage

    def delta_tasks(self, owners: set[str], ranges: set[tuple[int, int, int]]
                    ) -> list[WriteTask]:
        """This rank's tasks into engine ranks ``owners`` (all of them) or onto
        ``ranges`` ((region addr, offset, nbytes)): those to re-send dense."""
        return tasks_for_resend(self.groups, owners, ranges)

    def _source(self, buf: torch.Tensor) -> torch.Tensor:
        """Bytes to send: device memory where the NIC reads it (RDMA), else host memory."""
        if buf.is_cuda and not self.device_memory:
            buf = buf.cpu()
        return as_bytes(buf)

    def _stages(self) -> list[Stage]:
        return [
            Stage("h2d", self._h2d),
            Stage("prepare", self._prepare),
            Stage("write", self._write, concurrency=1 if self.serial else self.write_concurrency),
        ]

    async def _run_groups(self, version: int, wm: ByteWatermark, spans: list[Span],
                          barriers: list[Span]) -> float:
        """Every mesh group through the pipeline, then its barrier; the barriers' seconds."""
        barrier_s = 0.0
        for group, layouts in zip(self.groups, self.layouts, strict=True):
            pipe = Pipeline(self._stages(), watermark=wm)
            await pipe.run(self._items(layouts))
            if self.delta is not None and self.delta.active and group is self.groups[-1]:
                await self.delta.headers(self._run.writer.write,  # after every record landed
                                         records=self._write_records)
            spans.extend(pipe.spans)
            if group is self.groups[-1]:
                self.sources.release()  # this rank's writes are done: its sources are free
            if self.barrier is not None:
                t0 = time.perf_counter()
                barrier_s += await self.barrier.wait_async(f"v{version}/g{group.group}")
                barriers.append(Span(key=group.group, stage="barrier", start=t0,
                                     end=time.perf_counter(), nbytes=0))
        return barrier_s

    async def run(self, version: int, *, overlap: bool = False) -> TransferReport:
        """One update. ``overlap``: the trainer may step during it (``source="auto"`` then
        takes a snapshot: :mod:`weight_transfer.sender.zero_copy.sources`)."""
        start, cpu = time.perf_counter(), time.process_time()
        # Serial mode: a 1-byte watermark makes every item oversized, so each runs alone.
        wm = ByteWatermark(1 if self.serial else self.watermark_bytes,
                           on_change=self._watermark_changed)
        spans: list[Span] = []
        barriers: list[Span] = []
        self._task_spans: list[Span] = []
        self._run = run = RunLog(version=version, turn=self.turns,
                                 writer=RetryingWriter(self.transport, self.retry))
        self.turns += 1
        if self.arena is not None:
            self.arena.reset()  # leases of a failed earlier run were never released
        if self.collectives is not None:
            self.collectives.clear()
        delta = self.delta is not None and self.delta.active
        self._used = await self.sources.begin({n: self.get_param(n) for n in self.zero_copy},
                                              overlap=overlap, delta=delta)
        self._prepared = self._zero_copy_bytes = 0
        self._prepare_timer = ThreadTimer()
        self._num_items = sum(len(group) for group in self.layouts)
        try:
            barrier_s = await self._run_groups(version, wm, spans, barriers)
        finally:
            self.sources.release()
        self._watermark_changed(wm.held, last=True)
        report = TransferReport(
            rank=self.rank,
            version=version,
            seconds=time.perf_counter() - start,
            bytes_written=sum(sp.nbytes for sp in self._task_spans),
            bytes_planned=self.bytes_planned,
            writes=len(self._task_spans),
            params_gathered=sum(len(g.params) for g in self.groups),
            params_local=sum(len(g.local) for g in self.groups),
            barrier_seconds=barrier_s,
            watermark_peak=wm.peak,
            spans=tuple(spans),
            task_spans=tuple(self._task_spans),
            barrier_spans=tuple(barriers),
            retries=run.writer.retries,
            checksums=run.sums.ranges(),
            hash_seconds=run.hash_seconds,
            dest_bytes=dict(run.dest_bytes),
            source=self._used.mode,
            zero_copy_bytes=self._zero_copy_bytes,
            sources_refused=self._used.refused,
            cpu_seconds=time.process_time() - cpu,
            prepare_seconds=self._prepare_timer.wall,
            prepare_cpu_seconds=self._prepare_timer.cpu,
        )
        if delta and self.delta is not None:  # the time rule's fixed cost of a delta run
            self.delta.sender.measured_run(report.seconds)
        if self.metrics is not None:
            self.metrics.nic_transfer(nic=str(getattr(self.transport, "nic", "?")),
                                      rank=self.rank, nbytes=report.bytes_written,
                                      seconds=report.seconds)
        return report

    def close(self) -> None:
        self._gather_pool.shutdown(wait=False)
        self.attach_delta(None)
        self.sources.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

