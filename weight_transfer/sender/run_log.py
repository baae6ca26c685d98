"""What one run of a rank's transfer did with its WRITEs: retries, bytes, checksums.

A :class:`RunLog` is made per run (per version) by
:class:`~weight_transfer.sender.executor.RankTransfer`; every WRITE goes through its
``writer`` (retries, :mod:`weight_transfer.sender.retry`) and every WRITE that landed
is recorded with :meth:`RunLog.landed`: its bytes per engine rank and, when the
integrity policy selects it, the checksum of its source bytes
(:mod:`weight_transfer.integrity.checksums`; a piece sent to several replicas is hashed
once per run)::

    run = RunLog(version=7, turn=2, writer=RetryingWriter(nic, policy))  # turn: runs before
    await run.writer.write(src, task.region, task.region_offset)
    run.landed(task, src, integrity_policy)
    run.hash_piece(task, src, integrity_policy)   # a batched WRITE: hash now, ...
    run.landed(task, None, integrity_policy)      # ... land it without its bytes later
    run.sums.ranges(), run.dest_bytes, run.hash_seconds, run.writer.retries

:class:`TransferReport` is what the run hands back (the executor fills it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from weight_transfer.integrity.checksums import ChecksumLog, IntegrityPolicy, RangeSums, checksum
from weight_transfer.sender.pipeline import Span
from weight_transfer.sender.retry import RetryingWriter
from weight_transfer.types import EngineRankId, Piece, WriteTask


@dataclass(slots=True)
class RunLog:
    """One run's WRITE bookkeeping: retries, bytes per engine rank, checksums."""

    version: int
    writer: RetryingWriter
    turn: int = 0  # runs this sender made before, since its plan: the sample mode's rotation
    sums: ChecksumLog = field(default_factory=ChecksumLog)
    dest_bytes: dict[str, int] = field(default_factory=dict)
    hash_seconds: float = 0.0
    piece_sums: dict[Piece, int] = field(default_factory=dict)  # one hash per piece and run

    def hash_piece(self, task: WriteTask, src: torch.Tensor | None, policy: IntegrityPolicy,
                   *, value: int | None = None) -> None:
        """The checksum of ``task``'s piece bytes ``src``, now, where the policy selects the
        task (once per piece and run): a write that lands later (a delta record batched
        with others) is then :meth:`landed` without its bytes. ``value``: the XXH3-64 of
        those bytes, known already (a delta sender's digest of the bytes it keeps)."""
        if policy.selects(task.task_id, self.turn) and task.piece not in self.piece_sums:
            if value is None:
                start = time.perf_counter()
                value = checksum(src)
                self.hash_seconds += time.perf_counter() - start
            self.piece_sums[task.piece] = value

    def landed(self, task: WriteTask, src: torch.Tensor | None, policy: IntegrityPolicy
               ) -> None:
        """``task``'s WRITE landed (``src``: its piece's bytes; None when they were hashed
        by :meth:`hash_piece` already)."""
        dest = str(EngineRankId(replica=task.dst_replica, rank=task.dst_rank))
        self.dest_bytes[dest] = self.dest_bytes.get(dest, 0) + task.nbytes
        if policy.selects(task.task_id, self.turn):
            if task.piece not in self.piece_sums:  # sent to several replicas: hashed once
                if src is None:
                    raise AssertionError(f"task {task.task_id} landed unhashed")
                self.hash_piece(task, src, policy)
            self.sums.add(replica=task.dst_replica, rank=task.dst_rank, task=task.task_id,
                          addr=task.region.addr, offset=task.region_offset, length=task.nbytes,
                          value=self.piece_sums[task.piece])


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferReport:
    """What one rank's transfer of one version did (see the module docstring)."""

    rank: int
    version: int
    seconds: float
    bytes_written: int  # bytes of the WRITEs that completed
    bytes_planned: int  # bytes of the rank's tasks in the plan
    writes: int  # WRITEs that completed
    params_gathered: int
    barrier_seconds: float
    watermark_peak: int
    spans: tuple[Span, ...]  # one per (parameter, stage): key is the parameter name
    task_spans: tuple[Span, ...] = ()  # one per completed WRITE: key is the task id
    barrier_spans: tuple[Span, ...] = ()  # one per mesh group's barrier: key is the group
    retries: int = 0  # WRITEs tried again after a transient error (weight_transfer.sender.retry)
    checksums: tuple[RangeSums, ...] = ()  # hashed WRITEs per engine rank (integrity)
    hash_seconds: float = 0.0  # time spent hashing them
    dest_bytes: dict[str, int] = field(default_factory=dict, hash=False)  # "engine0/tp1": B
    params_local: int = 0  # shard-direct parameters written from the rank's own blocks
    source: str = "snapshot"  # what the update read from: zero_copy or snapshot (sources)
    zero_copy_bytes: int = 0  # planned bytes written straight from registered sources
    sources_refused: tuple[str, ...] = ()  # parameters whose registered source moved
    cpu_seconds: float = 0.0  # CPU of the whole process (every thread) during the run
    prepare_seconds: float = 0.0  # the prepare thread's wall in gathers and cuts, summed
    prepare_cpu_seconds: float = 0.0  # ... and its CPU
