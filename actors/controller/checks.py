"""After an update, before resume: do the engines hold the bytes the trainers wrote?

The trainers' reports carry the checksums of the WRITEs the integrity policy
selected (:mod:`weight_transfer.integrity.checksums`, per engine rank); every engine rank
of a replica that got all its writes hashes the same ranges of its registered
memory (``wt_checksum``, all ranks at once), and the two are compared here. A
replica with a mismatch, or whose rank could not answer within the timeout,
is torn: the controller keeps it paused and reports it::

    result = verify_update(policy=cfg.integrity, reports=rank_reports,
                           replicas={"engine0": [tp0, tp1]}, metas=engine_metas,
                           call=ledger.call, get=ledger.get, timeout_s=120)
    result.torn          # ["engine0"] if any range differs
    result.message()     # replica, rank, tensor, range, expected and actual checksum
    result.as_dict()     # mode, ranges, bytes, seconds, ok, mismatches (the audit log's)

A torn replica is re-synced from a peer elsewhere (the controller); this
module only finds it, and :func:`verify_copy` checks a replica filled from a
peer (re-sync, ``add_replica``) region by region against its source::

    result = verify_copy(source=src_actors, target=dst_actors, source_metas=src_metas,
                         target_metas=dst_metas, call=ledger.call, get=ledger.get,
                         timeout_s=120)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from actors.controller.engine_control import fault_kind_of
from actors.inference import regions_of
from weight_transfer.errors import FaultKind
from weight_transfer.integrity.checksums import (
    ADDR,
    ALGORITHM,
    CHECKSUM,
    LENGTH,
    NO_TASK,
    OFFSET,
    TASK,
    IntegrityPolicy,
    merge_ranges,
)
from weight_transfer.types import EngineRankId, EngineRankMeta


@dataclass(frozen=True, slots=True, kw_only=True)
class Mismatch:
    """One range whose engine bytes do not hash as the trainer's did (``fault``
    INTEGRITY), or that could not be checked (``actual`` None, ``error`` says why and
    ``fault`` what happened to the rank: UNRESPONSIVE, DEAD, FAILED)."""

    replica: str
    rank: int
    tensor: str  # the engine tensor the range starts in ("" if none)
    tensor_offset: int  # where the range starts in that tensor
    length: int
    task: int
    expected: int
    actual: int | None
    error: str = ""
    fault: FaultKind = FaultKind.INTEGRITY

    def describe(self) -> str:
        rank = EngineRankId(replica=self.replica, rank=self.rank)
        task = f" (task {self.task})" if self.task >= 0 else ""  # -1: not one WRITE
        where = (f"{rank} tensor {self.tensor!r} bytes "
                 f"[{self.tensor_offset}, {self.tensor_offset + self.length}){task}")
        if self.actual is None:
            return f"{where}: not checked: {self.error}"
        return (f"{where}: {ALGORITHM} expected {self.expected:#018x}, "
                f"engine holds {self.actual:#018x}")


@dataclass(frozen=True, slots=True, kw_only=True)
class IntegrityResult:
    """What one update's check found."""

    mode: str
    ranges: int  # ranges compared
    bytes: int  # engine bytes they cover
    seconds: float
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def torn(self) -> list[str]:
        return sorted({m.replica for m in self.mismatches})

    def message(self, limit: int = 5) -> str:
        shown = "; ".join(m.describe() for m in self.mismatches[:limit])
        more = f"; and {len(self.mismatches) - limit} more" if len(self.mismatches) > limit else ""
        return (f"integrity check ({self.mode}) failed for replicas {self.torn}: "
                f"{shown}{more}")

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "algorithm": ALGORITHM, "ranges": self.ranges,
                "bytes": self.bytes, "seconds": self.seconds, "ok": self.ok,
                "mismatches": [m.describe() for m in self.mismatches[:20]]}


def _tensor_at(meta: EngineRankMeta | None, addr: int, offset: int) -> tuple[str, int]:
    for t in meta.tensors if meta is not None else ():
        if t.region.addr == addr and t.offset <= offset < t.offset + t.nbytes:
            return t.name, offset - t.offset
    return "", offset


def _mismatch(replica: str, rank: int, meta: EngineRankMeta | None, row: np.ndarray,
              actual: int | None, error: str = "",
              fault: FaultKind = FaultKind.INTEGRITY) -> Mismatch:
    task, addr, offset, length, expected = (int(v) for v in row[[TASK, ADDR, OFFSET, LENGTH,
                                                                  CHECKSUM]])
    tensor, at = _tensor_at(meta, addr, offset)
    task = -1 if task == NO_TASK else task
    return Mismatch(replica=replica, rank=rank, tensor=tensor, tensor_offset=at, length=length,
                    task=task, expected=expected, actual=actual, error=error, fault=fault)


def _ray_pending(refs: list, timeout_s: float) -> list:
    return ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[1]


def answers(refs: list, get: Callable[[Any], Any], timeout_s: float,
            pending: Callable[[list, float], list] = _ray_pending
            ) -> list[tuple[np.ndarray | None, str, FaultKind]]:
    """Each ref's checksums, or None, why (late, failed) and the rank's fault kind."""
    late, out = pending(refs, timeout_s), []
    for ref in refs:
        if ref in late:
            out.append((None, f"did not answer within {timeout_s:g} s", FaultKind.UNRESPONSIVE))
            continue
        try:
            out.append((np.asarray(get(ref), dtype=np.uint64), "", FaultKind.INTEGRITY))
        except (ray.exceptions.RayError, ValueError) as err:
            out.append((None, f"{type(err).__name__}: {str(err).splitlines()[0]}",
                        fault_kind_of(err)))
    return out


def verify_update(*, policy: IntegrityPolicy, reports: Sequence[Any],
                  replicas: Mapping[str, Sequence[Any]],
                  metas: Mapping[str, Sequence[EngineRankMeta]],
                  call: Callable[..., Any], get: Callable[[Any], Any],
                  timeout_s: float,
                  pending: Callable[[list, float], list] = _ray_pending) -> IntegrityResult:
    """Compare the checksums in ``reports`` (RankReports) for the ranks of ``replicas``
    with what those engine ranks hold; see the module docstring. ``pending(refs,
    timeout_s)`` returns the refs that did not answer in time (default: ``ray.wait``)."""
    start = time.perf_counter()
    rows = {k: v for k, v in merge_ranges([s for r in reports for s in r.transfer.checksums])
            .items() if k[0] in replicas and len(v)}
    if not policy.enabled:
        rows = {}
    return compare_rows(mode=policy.mode, rows=rows, replicas=replicas, metas=metas, call=call,
                        get=get, timeout_s=timeout_s, pending=pending, start=start)


def compare_rows(*, mode: str, rows: Mapping[tuple[str, int], np.ndarray],
                 replicas: Mapping[str, Sequence[Any]],
                 metas: Mapping[str, Sequence[EngineRankMeta]],
                 call: Callable[..., Any], get: Callable[[Any], Any], timeout_s: float,
                 pending: Callable[[list, float], list] = _ray_pending,
                 start: float | None = None, checksum: str = "wt_checksum") -> IntegrityResult:
    """Hash ``rows`` (``{(replica, rank): uint64 [n, 5]}``, :data:`COLUMNS`) on their engine
    ranks, all at once, and compare with the rows' checksums (see :func:`verify_update`).
    ``checksum``: the rank method that hashes (``wt_live_checksum``: the memory a shadow-mode
    engine computes with)."""
    start = time.perf_counter() if start is None else start
    rows = {k: v for k, v in rows.items() if len(v)}
    if not rows:
        return IntegrityResult(mode=mode, ranges=0, bytes=0, seconds=time.perf_counter() - start)
    keys = sorted(rows)
    refs = [call(getattr(replicas[rep][rank], checksum), rows[(rep, rank)][:, ADDR:CHECKSUM])
            for rep, rank in keys]
    found: list[Mismatch] = []
    for (rep, rank), (got, why, fault) in zip(keys, answers(refs, get, timeout_s, pending),
                                              strict=True):
        want, meta = rows[(rep, rank)], _meta(metas, rep, rank)
        if got is None or len(got) != len(want):
            found.append(_mismatch(rep, rank, meta, want[0], None,
                                   why or f"answered {len(got)} checksums for {len(want)}",
                                   FaultKind.FAILED if got is not None else fault))
            continue
        for i in np.flatnonzero(got != want[:, CHECKSUM]).tolist():
            found.append(_mismatch(rep, rank, meta, want[i], int(got[i])))
    merged = np.concatenate([rows[k] for k in keys])
    return IntegrityResult(mode=mode, ranges=len(merged), bytes=int(merged[:, LENGTH].sum()),
                           seconds=time.perf_counter() - start, mismatches=tuple(found))


def _meta(metas: Mapping[str, Sequence[EngineRankMeta]], replica: str,
          rank: int) -> EngineRankMeta | None:
    return next((m for m in metas.get(replica, ()) if m.rank == rank), None)


def verify_copy(*, source: Sequence[Any], target: Sequence[Any],
                source_metas: Sequence[EngineRankMeta], target_metas: Sequence[EngineRankMeta],
                call: Callable[..., Any], get: Callable[[Any], Any], timeout_s: float,
                pending: Callable[[list, float], list] = _ray_pending,
                source_checksum: str = "wt_checksum") -> IntegrityResult:
    """After a replica was filled from a peer (re-sync, ``add_replica``): every registered
    region of each target rank must hash as the same region of its source rank
    (``source_checksum`` ``wt_live_checksum``: the source's live copy, shadow mode). Both
    sides hash whole regions, all ranks at once; a difference or a rank that does not
    answer is a Mismatch of the target replica (``task`` -1, the region's first tensor)."""
    start = time.perf_counter()
    refs, jobs = [], []
    for rank, (src, dst) in enumerate(zip(source_metas, target_metas, strict=True)):
        src_regions, dst_regions = regions_of(src), regions_of(dst)
        if len(src_regions) != len(dst_regions):
            raise ValueError(f"{dst.id} has {len(dst_regions)} regions, its source {src.id} "
                             f"{len(src_regions)}")
        rows = [np.array([[r.addr, 0, r.length] for r in regions], dtype=np.uint64)
                for regions in (src_regions, dst_regions)]
        refs += [call(getattr(source[rank], source_checksum), rows[0]),
                 call(target[rank].wt_checksum, rows[1])]
        jobs.append((dst, dst_regions))
    got_all = answers(refs, get, timeout_s, pending)
    found, nbytes = [], 0
    for k, (dst, regions) in enumerate(jobs):
        (want, why_src, _), (got, why_dst, fault_dst) = got_all[2 * k], got_all[2 * k + 1]
        for i, region in enumerate(regions):
            nbytes += region.length
            tensor, _ = _tensor_at(dst, region.addr, 0)
            whole = functools.partial(Mismatch, replica=dst.replica, rank=dst.rank, tensor=tensor,
                                      tensor_offset=0, length=region.length, task=-1)
            if want is None or got is None:
                found.append(whole(expected=0, actual=None, error=f"source: {why_src}"
                                   if want is None else why_dst,
                                   fault=FaultKind.FAILED if want is None else fault_dst))
            elif got[i] != want[i]:
                found.append(whole(expected=int(want[i]), actual=int(got[i])))
    return IntegrityResult(mode="copy", ranges=sum(len(r) for _, r in jobs), bytes=nbytes,
                           seconds=time.perf_counter() - start, mismatches=tuple(found))


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
