"""Checksums of what each replica serves: the reference its memory is checked against.

The check after an update runs before the resume; anything that writes into a
replica's memory afterwards would go unnoticed. So, where the controller keeps
watch, it records at every update, for each replica that got the version,
rows covering every byte that replica serves (the :data:`COLUMNS` of
:mod:`weight_transfer.integrity.checksums`: task, region address, offset, length,
checksum) and later hashes the same ranges of served memory again
(``actors.controller.served``)::

    book = ServedBook()
    book.record("engine0", ServedSums(version=7, source="trainers", ranks=(rows0, rows1)))
    book.copy("engine0", "engine1", addr_maps=[{a0: b0}, {a1: b1}])   # a peer copy
    picks = book.tick(budget_bytes=64 << 20, replicas=["engine0", "engine1"])
    picks[("engine0", 1)]            # the rows of that rank to hash in this tick
    book.drop("engine1")             # torn, removed, or its regions registered again

Two sources: ``trainers`` (every WRITE was hashed by its sender, integrity
mode ``full``: the rows are the trainers' own checksums of the source bytes),
or ``engine`` (sample mode: the engine ranks hash their tensors in chunks of
:func:`tensor_chunks`, while still paused, after the sampled check passed).

:meth:`ServedBook.tick` walks all recorded rows in one fixed order from a
cursor, a budget of bytes at a time (at least one row), so consecutive ticks
cover every row of every replica once before any row comes again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from weight_transfer.integrity.checksums import ADDR, COLUMNS, LENGTH, NO_TASK
from weight_transfer.layout.engine_copy import regions_of
from weight_transfer.types import EngineRankMeta

SOURCES = ("trainers", "engine")
DEFAULT_CHUNK_BYTES = 4 << 20  # engine-side reference: one row per 4 MiB of a tensor


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ServedSums:
    """The reference of one replica: ``ranks[r]`` is uint64 [n, 5] rows of its rank ``r``."""

    version: int
    source: str
    ranks: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"served checksums: source must be one of {list(SOURCES)}, "
                             f"not {self.source!r}")
        for r, rows in enumerate(self.ranks):
            if rows.ndim != 2 or rows.shape[1] != len(COLUMNS):
                raise ValueError(f"served checksums of rank {r}: rows must be [n, "
                                 f"{len(COLUMNS)}], not {rows.shape}")

    @property
    def nbytes(self) -> int:
        return sum(int(rows[:, LENGTH].sum()) for rows in self.ranks)

    @property
    def nrows(self) -> int:
        return sum(len(rows) for rows in self.ranks)


def tensor_chunks(meta: EngineRankMeta, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> np.ndarray:
    """Rows (task -1, addr, offset, length, checksum 0) covering every tensor of an engine
    rank in chunks of at most ``chunk_bytes``: what the engine hashes for its reference."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
    rows = []
    for t in meta.tensors:
        for start in range(0, t.nbytes, chunk_bytes):
            rows.append((NO_TASK, t.region.addr, t.offset + start,
                         min(chunk_bytes, t.nbytes - start), 0))
    return np.array(rows, dtype=np.uint64).reshape(-1, len(COLUMNS))


def rotate(lengths: np.ndarray, start: int, budget: int) -> tuple[np.ndarray, int]:
    """Indices of consecutive rows from ``start`` (wrapping) whose ``lengths`` add up to
    ``budget`` bytes (at least one row, at most all of them), and the next start."""
    n = len(lengths)
    if n == 0:
        return np.empty(0, dtype=np.int64), 0
    start %= n
    order = np.roll(np.arange(n), -start)
    cum = np.cumsum(np.asarray(lengths, dtype=np.uint64)[order])
    k = min(max(int(np.searchsorted(cum, budget, side="left")) + 1, 1), n)
    return order[:k], (start + k) % n


def remap(rows: np.ndarray, addr_map: Mapping[int, int]) -> np.ndarray:
    """``rows`` with each region address replaced by ``addr_map``'s (a peer copy's target
    has the same layout at other addresses); ValueError naming an address not in it."""
    out = rows.copy()
    for i, addr in enumerate(rows[:, ADDR].tolist()):
        if addr not in addr_map:
            raise ValueError(f"served checksums: row {i} is in region {addr:#x}, which the "
                             "copy's region map does not name")
        out[i, ADDR] = addr_map[addr]
    return out


class ServedBook:
    """The references of every replica, and the background check's cursor (see above)."""

    def __init__(self) -> None:
        self._sums: dict[str, ServedSums] = {}
        self._cursor = 0

    def __contains__(self, replica: str) -> bool:
        return replica in self._sums

    def get(self, replica: str) -> ServedSums | None:
        return self._sums.get(replica)

    def replicas(self) -> list[str]:
        return sorted(self._sums)

    def record(self, replica: str, sums: ServedSums) -> None:
        self._sums[replica] = sums

    def drop(self, replica: str) -> None:
        self._sums.pop(replica, None)

    def clear(self) -> None:
        self._sums.clear()

    def copy(self, source: str, target: str, *, addr_maps: Sequence[Mapping[int, int]]) -> bool:
        """``target`` was filled from ``source`` rank by rank: it serves the same bytes at
        its own addresses. False (target dropped) when ``source`` has no reference."""
        src = self._sums.get(source)
        if src is None or len(addr_maps) != len(src.ranks):
            self.drop(target)
            return False
        self._sums[target] = ServedSums(
            version=src.version, source=src.source,
            ranks=tuple(remap(rows, m) for rows, m in zip(src.ranks, addr_maps, strict=True)))
        return True

    def tick(self, *, budget_bytes: int, replicas: Iterable[str]
             ) -> dict[tuple[str, int], np.ndarray]:
        """The next rows to hash, about ``budget_bytes`` of them, among ``replicas``' rows,
        as ``{(replica, rank): rows}``; the cursor moves past them."""
        keys, lengths = [], []  # one key per rank; rows are found by their flat index
        for name in sorted(set(replicas) & set(self._sums)):
            for rank, rows in enumerate(self._sums[name].ranks):
                keys.append((name, rank))
                lengths.append(rows[:, LENGTH])
        if not keys or not sum(map(len, lengths)):
            return {}
        picked, self._cursor = rotate(np.concatenate(lengths), self._cursor, budget_bytes)
        starts = np.cumsum([0] + [len(x) for x in lengths])
        owner = np.searchsorted(starts, np.sort(picked), side="right") - 1
        out = {}
        for k in np.unique(owner).tolist():
            idx = np.sort(picked)[owner == k] - starts[k]
            name, rank = keys[k]
            out[(name, rank)] = self._sums[name].ranks[rank][idx]
        return out

    def all_rows(self, replicas: Iterable[str]) -> dict[tuple[str, int], np.ndarray]:
        """Every row of ``replicas`` (a full check)."""
        return {(name, rank): rows for name in sorted(set(replicas) & set(self._sums))
                for rank, rows in enumerate(self._sums[name].ranks) if len(rows)}


def region_maps(source: Sequence[EngineRankMeta], target: Sequence[EngineRankMeta]
                ) -> list[dict[int, int]]:
    """Per rank, each source region's address -> the address of the target's region at the
    same position (the layout a peer copy needs)."""
    return [{a.addr: b.addr for a, b in zip(regions_of(src), regions_of(dst), strict=True)}
            for src, dst in zip(source, target, strict=True)]
