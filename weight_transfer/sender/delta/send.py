"""Trainer side of sparse deltas: the bytes last written per piece, and the records that
turn an engine's copy of them into this step's bytes, written one-sided.

Works on "the exact engine-format bytes a rank is about to write for one piece",
whatever produced them (a gather, or the rank's own shard), so it sits between
``prepare`` and ``write`` of :mod:`weight_transfer.sender.executor`. Per update::

    sender = DeltaSender(slots, transport=nic, rank=0)   # once: slots in engine arenas
    sender.begin(DeltaDirective(version=8, anchor=False, held={"engine0": 7}))
    enc = sender.encode(piece, buf)        # diff against the base, smallest encoding;
                                           # the base becomes buf (a thread may run this)
    where = sender.place(task, enc)        # (source, region, offset) of its record in the
                                           # engine's arena, or None: write it dense
    for run in sender.take(min_bytes=0): ... # records placed back to back: one WRITE each
    for src, region, off in sender.finish(): ...   # one slot header per engine rank, last

A task goes dense when the update is an anchor, when its replica does not hold the
base version the record names (stale or torn: the controller's view, ``held``),
when the delta would not be smaller than the piece, when its slot is full, or
when the rank's time rule (:mod:`weight_transfer.delta.policy`, with ``rates``)
says a dense update costs it less time than deltas (``dense_time``: such a
piece is not diffed at all; its kept bytes are refreshed by a copy).
Each slot is mirrored in a local buffer registered once as a write source, so a
record is built where it is sent from; :meth:`DeltaSender.repair` gives the dense
bytes of ranges an engine could not apply (its digest or version differed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from weight_transfer.delta.codec import (
    RECORD,
    RECORD_MAGIC,
    SLOT_HEADER,
    Encoding,
    Record,
    changed,
    digest,
    elements,
    encode,
    pack_slot_header,
)
from weight_transfer.delta.policy import Choice, DeltaRates
from weight_transfer.sender.delta.source import KeptSource, fp8_changes, keep_source, supported
from weight_transfer.sender.staging import allocate_staging
from weight_transfer.types import Piece, RegionDesc, WriteTask

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaSlot:
    """This trainer rank's slot in one engine rank's delta arena (bytes at ``offset``)."""

    region: RegionDesc
    offset: int
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaDirective:
    """What the controller says before an update: dense for all (``anchor``), and the
    version each replica holds completely (None: torn or never filled), and the engines'
    measured apply seconds per destination byte (None: not measured yet), and the
    controller's fixed part of a delta update (``fixed_s``, the time rule's ``F_update``;
    None: not measured yet)."""

    version: int
    anchor: bool = False
    held: dict[str, int | None] = field(default_factory=dict, hash=False)
    apply_s_per_byte: float | None = None
    fixed_s: float | None = None


@dataclass(slots=True)
class Base:
    """The bytes of a piece last written, with their version and digest."""

    version: int
    data: np.ndarray
    digest: int


@dataclass(slots=True)
class Encoded:
    """A piece's record (header + payload, ready to copy), or None when it goes dense."""

    piece: Piece
    record: np.ndarray | None
    meta: Record | None


@dataclass(slots=True)
class RecordRun:
    """Records placed back to back in one engine rank's slot since the last
    :meth:`DeltaSender.take`: one WRITE of ``src`` at ``offset`` of ``region`` lands them all
    (a WRITE per record costs more than its bytes on every NIC we have)."""

    src: torch.Tensor
    region: RegionDesc
    offset: int
    tasks: list[WriteTask]


@dataclass(slots=True)
class DeltaStats:
    """Counters of one update on this rank (``as_dict`` crosses Ray)."""

    pieces: int = 0
    delta_tasks: int = 0
    dense_tasks: int = 0
    delta_wire_bytes: int = 0  # records and slot headers written
    dense_wire_bytes: int = 0  # bytes of tasks written dense
    elements: int = 0
    changed: int = 0
    encodings: dict[str, int] = field(default_factory=dict)
    scale_blocks: int = 0  # FP8 128x128 blocks (scale elements) diffed
    scale_blocks_changed: int = 0  # ... whose scale changed (their bytes re-sent)
    diff_s: float = 0.0
    encode_s: float = 0.0
    base_bytes: int = 0  # host memory holding the last written bytes (and FP8 sources)
    diffed_bytes: int = 0  # engine bytes of the pieces diffed
    diffed_pieces: int = 0  # ... and their count (the time rule's encode rate)
    encode_cpu_s: float = 0.0  # this thread's CPU seconds of those diffs and encodes
    fallback: str = ""  # the time rule's decision and why (delta_policy); "" without one
    est_delta_s: float | None = None
    est_dense_s: float | None = None
    est_fixed_s: float | None = None  # of est_delta_s: the fixed cost (F_rank + F_update)
    time_dense_pieces: int = 0  # pieces written dense by the time rule, not diffed
    source_pieces: int = 0  # FP8 pieces whose changes came from the source (delta_source)
    source_s: float = 0.0  # ... the time that took (diff and quantization of changes)
    source_cpu_s: float = 0.0  # ... and its CPU (the prepare thread's)
    encode_thread_s: float = 0.0  # wall of the encoding thread's batches (every piece)
    encode_thread_cpu_s: float = 0.0  # ... and its CPU

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def itemsize_of(piece: Piece) -> int:
    return getattr(torch, piece.dst_dtype).itemsize


class DeltaSender:
    """See the module docstring."""

    def __init__(self, slots: Mapping[str, DeltaSlot], *, transport: object = None,
                 rank: int = 0, rates: DeltaRates | None = None, written: int = 0) -> None:
        self.rank, self.slots = rank, dict(slots)
        # the time rule (None: always deltas), and the bytes this rank's tasks write
        self.rates, self.written = rates, written
        self.choice: Choice | None = None
        self.turn = 0
        self._index = 0
        self.sources: dict[Piece, KeptSource] = {}  # FP8 weight piece -> its source kept
        self._pre: dict[Piece, np.ndarray] = {}  # changed indices found from the source
        self._lock = threading.Lock()  # encode (delta thread) and prepare_fp8 (gather)
        self.base: dict[Piece, Base] = {}
        self.layout: dict[str, int] = {}
        total = 0
        for owner, slot in self.slots.items():
            if slot.size <= SLOT_HEADER:
                raise ValueError(f"trainer rank {rank}: delta slot of {slot.size} B in "
                                 f"{owner}'s arena cannot hold its {SLOT_HEADER} B header")
            self.layout[owner] = total
            total += slot.size
        self.mirror = allocate_staging(max(total, 1), None).numpy()
        self.transport = transport
        register = getattr(transport, "register_source", None)
        self._handle = register(torch.from_numpy(self.mirror)) if register else None
        self.directive = DeltaDirective(version=0, anchor=True)
        self.stats = DeltaStats()
        self._cursor: dict[str, int] = {}
        self._count: dict[str, int] = {}
        self._taken: dict[str, int] = {}  # slot offset up to which records were taken
        self._placed: dict[str, list[WriteTask]] = {}  # ... and the tasks placed after it
        self._dense_busy: float | None = None  # a mostly dense run's writes in flight (s)

    # ---------------------------------------------------------------- one update

    def begin(self, directive: DeltaDirective) -> None:
        self.directive = directive
        kept = sum(b.data.nbytes for b in self.base.values())
        kept += sum(k.data.nbytes + k.amax.nbytes for k in self.sources.values())
        self.stats = DeltaStats(base_bytes=kept)
        self.choice, self._index = None, 0
        self._pre.clear()  # (indices of a run that failed before its encode)
        if self.rates is not None and not directive.anchor and self.base:
            self.turn += 1
            self.choice = self.rates.choose(pieces=len(self.base), written=self.written,
                                            apply_s_per_byte=directive.apply_s_per_byte,
                                            turn=self.turn, fixed_s=directive.fixed_s)
            self.stats.fallback = self.choice.reason
            self.stats.est_delta_s = self.choice.est_delta_s
            self.stats.est_dense_s = self.choice.est_dense_s
            self.stats.est_fixed_s = self.choice.fixed_s
        self._cursor = {o: SLOT_HEADER for o in self.slots}
        self._count = {o: 0 for o in self.slots}
        self._taken = dict(self._cursor)
        self._placed = {o: [] for o in self.slots}

    def prepare_fp8(self, weight: Piece, scale: Piece, rect: torch.Tensor) -> bool:
        """New bytes of an FP8 weight piece and its scale piece from the source rectangle
        (:mod:`weight_transfer.sender.delta.source`): True when both bases now hold them (the
        changed indices wait for :meth:`encode`); False: quantize them as usual."""
        bw, bs, kept = self.base.get(weight), self.base.get(scale), self.sources.get(weight)
        if (self.directive.anchor or bw is None or bs is None or kept is None
                or weight in self._pre or not supported(rect)):
            return False
        with self._lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            got = fp8_changes(kept, rect, bw.data, bs.data.view(np.float32))
            self.stats.source_s += time.perf_counter() - t0
            self.stats.source_cpu_s += time.thread_time() - c0
            if got is None:
                return False
            self._pre[weight], self._pre[scale] = got
            self.stats.source_pieces += 2
        return True

    def keep_fp8_source(self, weight: Piece, rect: torch.Tensor) -> None:
        """Keep ``rect`` (after the piece was quantized whole) for :meth:`prepare_fp8`."""
        if supported(rect):
            with self._lock:
                self.sources[weight] = keep_source(rect)

    def encode(self, piece: Piece, buf: torch.Tensor) -> Encoded:
        """Diff ``buf`` (the piece's engine bytes, uint8) against the base, encode it, and
        make ``buf`` the base of the next update."""
        with self._lock:
            return self._encode(piece, buf)

    def _encode(self, piece: Piece, buf: torch.Tensor) -> Encoded:
        pre = self._pre.pop(piece, None)  # the base holds the new bytes already
        new = buf.cpu().numpy() if buf.is_cuda else buf.numpy()
        version, st = self.directive.version, self.stats
        st.pieces += 1
        base = self.base.get(piece)
        if base is None:
            data = np.empty(new.nbytes, dtype=np.uint8)
            data[:] = new
            self.base[piece] = Base(version=version, data=data, digest=digest(data))
            st.base_bytes += data.nbytes
            return Encoded(piece=piece, record=None, meta=None)
        size = itemsize_of(piece)
        index, self._index = self._index, self._index + 1
        choice = self.choice
        if choice is not None and not choice.delta and not choice.probe(index):
            if pre is None:
                base.data[:] = new  # dense by the time rule: no diff, the kept bytes refreshed
            base.version, base.digest = version, digest(base.data)
            st.time_dense_pieces += 1
            return Encoded(piece=piece, record=None, meta=None)
        t0, c0 = time.perf_counter(), time.thread_time()
        if pre is not None:
            idx = pre
        else:
            idx = changed(base.data, new, size) if not self.directive.anchor else None
        t1 = time.perf_counter()
        st.diff_s += t1 - t0
        out = Encoded(piece=piece, record=None, meta=None)
        if idx is not None:
            st.diffed_bytes += new.nbytes
            st.diffed_pieces += 1
            n = new.nbytes // size if new.nbytes % size == 0 else new.nbytes
            st.elements += n
            st.changed += idx.size
            if piece.dst_tensor.endswith("_scale_inv"):
                st.scale_blocks += n
                st.scale_blocks_changed += idx.size
            kind, payload = encode(new, idx, size)
            if kind is not Encoding.DENSE and RECORD.size + payload.nbytes < new.nbytes:
                out = self._record(piece, base, new, kind, payload, idx.size, size)
            st.encodings[kind.name] = st.encodings.get(kind.name, 0) + 1
        if idx is None:
            base.data[:] = new
        else:  # only the changed elements: a scatter, not a copy of the piece
            view = elements(base.data, size)
            view[idx] = elements(new, size)[idx]
        base.version, base.digest = version, digest(base.data)
        if out.meta is not None:
            out.meta = _with_new_digest(out.meta, base.digest)
            out.meta.pack_into(out.record, 0)
        st.encode_s += time.perf_counter() - t1
        if idx is not None:
            st.encode_cpu_s += time.thread_time() - c0
        return out

    @staticmethod
    def _record(piece: Piece, base: Base, new: np.ndarray, kind: Encoding,
                payload: np.ndarray, count: int, size: int) -> Encoded:
        meta = Record(kind=kind, itemsize=size, region_addr=0, region_offset=0,
                      nbytes=new.nbytes, payload=payload.nbytes, base_version=base.version,
                      base_digest=base.digest, new_digest=0, count=count)
        rec = np.zeros(meta.wire_bytes, dtype=np.uint8)
        rec[RECORD.size : RECORD.size + payload.nbytes] = payload
        return Encoded(piece=piece, record=rec, meta=meta)

    def place(self, task: WriteTask, enc: Encoded) -> tuple[torch.Tensor, RegionDesc, int] | None:
        """Where ``task``'s record goes (source view, the arena's region, offset), or None:
        the task is written dense. Runs on the event loop (cursors are not locked)."""
        owner, st = task.region.owner, self.stats
        slot = self.slots.get(owner)
        ok = (enc.meta is not None and slot is not None and not self.directive.anchor
              and self.directive.held.get(task.dst_replica) == enc.meta.base_version)
        at = self._cursor.get(owner, 0)
        if not ok or at + enc.record.nbytes > slot.size:
            st.dense_tasks += 1
            st.dense_wire_bytes += task.nbytes
            return None
        rec = enc.record
        RECORD.pack_into(rec, 0, *_fields(enc.meta, task))
        start = self.layout[owner] + at
        self.mirror[start : start + rec.nbytes] = rec
        self._cursor[owner] = at + rec.nbytes
        self._count[owner] += 1
        self._placed[owner].append(task)
        st.delta_tasks += 1
        st.delta_wire_bytes += rec.nbytes
        src = torch.from_numpy(self.mirror[start : start + rec.nbytes])
        return src, slot.region, slot.offset + at

    def take(self, *, min_bytes: int = 0) -> list[RecordRun]:
        """Per engine rank with at least ``min_bytes`` (and one record) placed since the
        last take, those records as one run (their bytes are contiguous in the slot and in
        its mirror); they count as taken."""
        out = []
        for owner, tasks in self._placed.items():
            at, end = self._taken[owner], self._cursor[owner]
            if not tasks or end - at < min_bytes:
                continue
            start, slot = self.layout[owner], self.slots[owner]
            out.append(RecordRun(src=torch.from_numpy(self.mirror[start + at : start + end]),
                                 region=slot.region, offset=slot.offset + at, tasks=tasks))
            self._taken[owner], self._placed[owner] = end, []
        return out

    def measured(self, dense_bytes: int, dense_seconds: float) -> None:
        """After an update: its encode rate, and (when dense writes were most of its bytes)
        the rank's dense write rate, into ``rates``."""
        st = self.stats
        if self.rates is None:
            return
        self.rates.measured_encode(st.encode_cpu_s, st.diffed_pieces,
                                   whole=st.diffed_pieces * 2 > len(self.base))
        if dense_bytes * 2 >= self.written:
            self.rates.measured_dense(dense_bytes, dense_seconds)
            self._dense_busy = dense_seconds

    def measured_run(self, seconds: float) -> None:
        """After a run of ``seconds`` wall: where it diffed most pieces, its fixed cost (the
        wall its encode CPU does not explain) into ``rates`` (the time rule's ``F_rank``);
        where it wrote most bytes dense, the wall its dense writes do not (``F_dense``)."""
        st, busy, self._dense_busy = self.stats, self._dense_busy, None
        if self.rates is None:
            return
        if st.diffed_pieces * 2 > len(self.base):
            self.rates.measured_fixed(seconds, st.encode_cpu_s)
        elif busy is not None:  # mostly dense: its fixed cost, the time rule's F_dense
            self.rates.measured_dense_fixed(seconds, busy)

    def finish(self) -> list[tuple[torch.Tensor, RegionDesc, int]]:
        """One slot header per engine rank (written after every record landed): the
        version, the records and their digest; a slot with none says so too."""
        out = []
        for owner, slot in self.slots.items():
            start = self.layout[owner]
            used = self._cursor.get(owner, SLOT_HEADER) - SLOT_HEADER
            view = self.mirror[start : start + slot.size]
            pack_slot_header(view, version=self.directive.version,
                             records=self._count.get(owner, 0), used=used)
            self.stats.delta_wire_bytes += SLOT_HEADER
            out.append((torch.from_numpy(view[:SLOT_HEADER]), slot.region, slot.offset))
        return out

    def repair(self, tasks: list[WriteTask]) -> list[tuple[torch.Tensor, WriteTask]]:
        """The bytes last written (this version's) of ``tasks``: their dense re-send."""
        out = []
        for t in tasks:
            base = self.base.get(t.piece)
            if base is None:
                raise RuntimeError(f"trainer rank {self.rank}: no bytes kept for task "
                                   f"{t.task_id} ({t.piece.dst_tensor}) to repair")
            out.append((torch.from_numpy(base.data), t))
        return out

    def close(self) -> None:
        if self._handle is not None:
            self.transport.deregister_source(self._handle)
            self._handle = None


def _with_new_digest(meta: Record, new_digest: int) -> Record:
    return Record(kind=meta.kind, itemsize=meta.itemsize, region_addr=0, region_offset=0,
                  nbytes=meta.nbytes, payload=meta.payload, base_version=meta.base_version,
                  base_digest=meta.base_digest, new_digest=new_digest, count=meta.count)


def _fields(meta: Record, task: WriteTask) -> tuple:
    return (RECORD_MAGIC, int(meta.kind), meta.itemsize, 0, task.region.addr,
            task.region_offset, meta.nbytes, meta.payload, meta.base_version,
            meta.base_digest, meta.new_digest, meta.count)
