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

An update asks each engine rank once: :func:`compare_and_hash` sends the sampled
ranges of :func:`update_rows` and, in the same request, the ranges of the
served-memory reference (:mod:`actors.controller.served`), and splits the answer;
:func:`unchecked_faults` turns the ranks that did not answer into faults of their
replicas.

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
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from actors.controller.engine_control import RankFault, fault_kind_of
from actors.inference import regions_of
from weight_transfer.engines.rank import EngineRank, method_name
from weight_transfer.errors import FaultKind
from weight_transfer.integrity.checksums import (
    ADDR,
    ALGORITHM,
    CHECKSUM,
    COLUMNS,
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


def update_rows(policy: IntegrityPolicy, reports: Sequence[Any],
                replicas: Collection[str]) -> dict[tuple[str, int], np.ndarray]:
    """The ranges the trainers hashed into the ranks of ``replicas`` (``{(replica, rank):
    uint64 [n, 5]}``, :data:`COLUMNS`); none where ``policy`` is off."""
    if not policy.enabled:
        return {}
    return {k: v for k, v in merge_ranges([s for r in reports for s in r.transfer.checksums])
            .items() if k[0] in replicas and len(v)}


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
    return compare_rows(mode=policy.mode, rows=update_rows(policy, reports, replicas),
                        replicas=replicas, metas=metas, call=call, get=get,
                        timeout_s=timeout_s, pending=pending, start=start)


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
    return compare_and_hash(mode=mode, rows=rows, replicas=replicas, metas=metas, call=call,
                            get=get, timeout_s=timeout_s, pending=pending, start=start,
                            checksum=checksum)[0]


Hashed = dict[tuple[str, int], tuple[np.ndarray | None, str]]


def compare_and_hash(*, mode: str, rows: Mapping[tuple[str, int], np.ndarray],
                     replicas: Mapping[str, Sequence[Any]],
                     metas: Mapping[str, Sequence[EngineRankMeta]],
                     call: Callable[..., Any], get: Callable[[Any], Any], timeout_s: float,
                     pending: Callable[[list, float], list] = _ray_pending,
                     start: float | None = None, checksum: str = "wt_checksum",
                     also: Mapping[tuple[str, int], np.ndarray] | None = None
                     ) -> tuple[IntegrityResult, Hashed]:
    """:func:`compare_rows`, and in the same request to each engine rank the ranges of
    ``also`` (rows of the same columns, e.g. the served-memory reference an update takes):
    one request per rank for both. Returns the comparison of ``rows`` and, per key of
    ``also``, its rows with the checksums the rank answered (or None, and why not); a
    rank that answered nothing for its ``also`` rows alone is no mismatch."""
    start = time.perf_counter() if start is None else start
    rows = {k: v for k, v in rows.items() if len(v)}
    also = dict(also or {})
    keys = sorted(rows.keys() | also.keys())
    if not keys:
        return IntegrityResult(mode=mode, ranges=0, bytes=0,
                               seconds=time.perf_counter() - start), {}
    empty = np.empty((0, len(COLUMNS)), dtype=np.uint64)
    asked = {k: np.concatenate([rows.get(k, empty), also.get(k, empty)]) for k in keys}
    refs = [call(getattr(replicas[rep][rank], checksum), asked[(rep, rank)][:, ADDR:CHECKSUM])
            for rep, rank in keys]
    found: list[Mismatch] = []
    hashed: Hashed = {}
    for (rep, rank), (got, why, fault) in zip(keys, answers(refs, get, timeout_s, pending),
                                              strict=True):
        want, n = rows.get((rep, rank), empty), len(asked[(rep, rank)])
        if got is not None and len(got) != n:
            got, why, fault = None, f"answered {len(got)} checksums for {n}", FaultKind.FAILED
        if (rep, rank) in also:
            extra = None if got is None else also[(rep, rank)].copy()
            if extra is not None:
                extra[:, CHECKSUM] = got[len(want):]
            hashed[(rep, rank)] = (extra, why)
        if not len(want):
            continue
        meta = _meta(metas, rep, rank)
        if got is None:
            found.append(_mismatch(rep, rank, meta, want[0], None, why, fault))
            continue
        for i in np.flatnonzero(got[:len(want)] != want[:, CHECKSUM]).tolist():
            found.append(_mismatch(rep, rank, meta, want[i], int(got[i])))
    merged = np.concatenate([rows[k] for k in keys if k in rows] or [empty])
    return IntegrityResult(mode=mode, ranges=len(merged), bytes=int(merged[:, LENGTH].sum()),
                           seconds=time.perf_counter() - start,
                           mismatches=tuple(found)), hashed


def unchecked_faults(check: IntegrityResult) -> dict[str, list[RankFault]]:
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
