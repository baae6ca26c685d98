"""Engine side of sparse deltas: the delta arena a rank registers once, and the in-place
apply at the end of an update (the only engine-side code of a delta update, run where
the engine's own post-load processing runs: at finish).

The arena holds one slot per trainer rank that writes to this engine rank, sized
by :func:`arena_layout` from the bytes that rank writes here (``fraction`` of them:
a delta that does not fit goes dense). Trainers write records and then each its
slot header (:mod:`weight_transfer.delta.codec`); the engine never runs during the
writes. At finish::

    arena = DeltaArena(slots, owner="engine0/tp0")   # once, at setup
    region = arena.register(nic)                      # registered once, reused
    done = arena.apply(version=8, held=7, buffers=mem.buffers)
    done.stale, done.bad_slots    # ranges not applied: the trainers re-send them dense

A record is applied only if it names this version's slot, the base version the
rank holds (``held``) and the XXH3-64 digest of the bytes there now; after the
scatter the result must hash to the record's new digest. Anything else is
reported (``stale``: the record's range; ``bad_slots``: a slot that is missing,
of another version or torn, whose trainer re-sends every range it writes here),
so the chain cannot drift: a range is either provably the trainer's bytes, or
re-sent whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weight_transfer.delta.codec import SLOT_HEADER, apply, digest, read_slot
from weight_transfer.sender.host_memory import alloc_buffer
from weight_transfer.types import RegionDesc

log = logging.getLogger(__name__)

MIN_SLOT = 64 << 10  # room for a few records even for a rank that writes little here


def arena_layout(need: Mapping[int, int], fraction: float
                 ) -> tuple[dict[int, tuple[int, int]], int]:
    """Per trainer rank (bytes it writes to this engine rank), its slot ``(offset,
    size)`` holding ``fraction`` of them (at least :data:`MIN_SLOT`); and the arena's
    size."""
    if not 0 < fraction <= 1:
        raise ValueError(f"delta arena fraction must be in (0, 1], not {fraction}")
    slots, at = {}, 0
    for rank in sorted(need):
        size = max(MIN_SLOT, -(-int(need[rank] * fraction + SLOT_HEADER) // 4096) * 4096)
        slots[rank] = (at, size)
        at += size
    return slots, max(at, 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaApplied:
    """What one engine rank's apply did (crosses Ray)."""

    owner: str
    version: int
    records: int = 0  # records applied
    bytes: int = 0  # destination bytes they cover
    changed: int = 0  # elements they wrote
    seconds: float = 0.0  # the whole apply: slot checks, digests, scatters
    cpu_seconds: float = 0.0  # ... its CPU (the applying thread's)
    stale: tuple[tuple[int, int, int], ...] = ()  # (region addr, offset, nbytes) not applied
    bad_slots: tuple[int, ...] = ()  # trainer ranks whose slot could not be read
    reasons: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.stale and not self.bad_slots


def _numpy(buf: Any) -> np.ndarray:
    return buf.numpy() if isinstance(buf, torch.Tensor) else np.asarray(buf)


class DeltaArena:
    """See the module docstring."""

    def __init__(self, slots: Mapping[int, tuple[int, int]], *, owner: str) -> None:
        self.owner, self.slots = owner, dict(slots)
        self.nbytes = max((o + s for o, s in self.slots.values()), default=1)
        self._mapping, start, _ = alloc_buffer(self.nbytes)
        raw = memoryview(self._mapping)[start : start + self.nbytes]
        self.buffer = torch.frombuffer(raw, dtype=torch.uint8)
        self.region: RegionDesc | None = None
        self._nic: Any = None

    def fits(self, slots: Mapping[int, tuple[int, int]]) -> bool:
        return dict(slots) == self.slots

    def registered_on(self, nic: Any) -> bool:
        """Whether the arena's region lives on ``nic`` (a rank that registered its memory
        again, e.g. the shadow in place of live memory, has new NICs)."""
        return self.region is not None and self._nic is nic

    def register(self, nic: Any) -> RegionDesc:
        if self.region is None:
            self.region, self._nic = nic.register(self.buffer), nic
        return self.region

    def deregister(self) -> None:
        if self.region is not None:
            self._nic.deregister(self.region)
            self.region = None

    def apply(self, *, version: int, held: int | None,
              buffers: Mapping[int, Any]) -> DeltaApplied:
        """Apply every record of ``version`` in place (see the module docstring)."""
        start, cpu = time.perf_counter(), time.thread_time()
        arena = self.buffer.numpy()
        views = {addr: _numpy(b) for addr, b in buffers.items()}
        stale, bad, reasons = [], [], []
        records = nbytes = changed = 0
        for rank, (off, size) in sorted(self.slots.items()):
            try:
                got, recs = read_slot(arena[off : off + size])
                if got != version:
                    raise ValueError(f"slot holds version {got}")
            except (ValueError, IndexError) as exc:
                bad.append(rank)
                reasons.append(f"trainer rank {rank}'s slot: {exc}")
                continue
            for rec, payload in recs:
                why = self._apply_one(rec, payload, held, views)
                if why is None:
                    records += 1
                    nbytes += rec.nbytes
                    changed += rec.count
                else:
                    stale.append((rec.region_addr, rec.region_offset, rec.nbytes))
                    reasons.append(why)
        done = DeltaApplied(owner=self.owner, version=version, records=records, bytes=nbytes,
                            changed=changed, seconds=time.perf_counter() - start,
                            cpu_seconds=time.thread_time() - cpu,
                            stale=tuple(stale), bad_slots=tuple(bad),
                            reasons=tuple(reasons[:8]))
        if not done.ok:
            log.warning("%s: delta of version %d: %d ranges stale, slots of trainer ranks %s "
                        "unreadable (%s)", self.owner, version, len(stale), bad, reasons[:2])
        return done

    @staticmethod
    def _apply_one(rec: Any, payload: np.ndarray, held: int | None,
                   views: Mapping[int, np.ndarray]) -> str | None:
        """Apply one record; why not (None: applied and checked)."""
        buf = views.get(rec.region_addr)
        where = f"region {rec.region_addr:#x} +{rec.region_offset} ({rec.nbytes} B)"
        if buf is None or rec.region_offset + rec.nbytes > buf.nbytes:
            return f"{where}: not a registered range"
        if rec.base_version != held:
            return f"{where}: base version {rec.base_version}, rank holds {held}"
        dst = buf[rec.region_offset : rec.region_offset + rec.nbytes]
        if digest(dst) != rec.base_digest:
            return f"{where}: base bytes differ from the trainer's (digest)"
        try:
            apply(dst, rec.kind, payload, rec.itemsize, rec.count)
        except ValueError as exc:
            return f"{where}: {exc}"
        if digest(dst) != rec.new_digest:
            return f"{where}: result differs from the trainer's bytes (digest)"
        return None


__all__ = ["MIN_SLOT", "SLOT_HEADER", "DeltaApplied", "DeltaArena", "arena_layout"]
