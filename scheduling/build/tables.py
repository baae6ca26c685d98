"""Flat tables of plan inputs: engine tensors and pieces as numpy columns.

A plan at Kimi-K2 scale has about a million tasks; looking names up in Python
dicts per task would dominate planning. These helpers intern names and dtypes
to integers once and turn engine tensors and pieces into columns, so that the
builder (:mod:`scheduling.build.build`) and the checker (:mod:`scheduling.build.validate`)
work with vectorized numpy::

    names, dtypes = Interner(), Interner()
    et = engine_table(engines, names, dtypes)      # rows = every tensor of every rank
    pt = piece_table(pieces, param_index, names, dtypes)
    rows = et.lookup[engine_idx, pt.name[piece_idx]]   # tensor row, -1 if absent
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from weight_transfer.plan.wire import Interner
from weight_transfer.types import EngineRankMeta, Piece, RegionDesc, dtype_size


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class EngineTable:
    """Every tensor of every engine rank as one row; ``lookup[engine, name]`` -> row or -1."""

    regions: tuple[RegionDesc, ...]
    engine: np.ndarray
    name: np.ndarray
    region: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    dtype: np.ndarray
    lookup: np.ndarray


def engine_table(
    engines: Sequence[EngineRankMeta], names: Interner, dtypes: Interner
) -> EngineTable:
    """Flatten engine metas; duplicate tensor names on one rank are a ValueError."""
    region_ids: dict[RegionDesc, int] = {}
    # ranks of one shard list the same names, shapes and dtypes: their columns once
    columns: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    cols: list[list[np.ndarray]] = [[] for _ in range(6)]
    for e, meta in enumerate(engines):
        tensors = meta.tensors
        key = tuple(map(_NAME_SHAPE_DTYPE, tensors))
        shared = columns.get(key)
        if shared is None:
            shared = columns[key] = _tensor_columns(meta, names, dtypes)
        ids, sizes, dtype_ids = shared
        for col, v in zip(cols, (
            np.full(len(key), e, dtype=np.int64),
            ids,
            _region_column(tensors, region_ids),
            np.fromiter(map(_OFFSET, tensors), np.int64, count=len(key)),
            sizes,
            dtype_ids,
        ), strict=True):
            col.append(v)
    empty = np.zeros(0, dtype=np.int64)
    engine, name, region, offset, nbytes, dtype = (
        np.concatenate(c) if c else empty for c in cols
    )
    lookup = np.full((len(engines), max(len(names), 1)), -1, dtype=np.int64)
    lookup[engine, name] = np.arange(len(engine))
    return EngineTable(
        regions=tuple(region_ids),
        engine=engine,
        name=name,
        region=region,
        offset=offset,
        nbytes=nbytes,
        dtype=dtype,
        lookup=lookup,
    )


def _tensor_columns(meta: EngineRankMeta, names: Interner, dtypes: Interner):
    """(name ids, byte sizes, dtype ids) of one rank's tensors; ValueError on duplicates."""
    key = tuple(map(_NAME, meta.tensors))
    if len(set(key)) != len(key):
        dup = sorted({n for n in key if key.count(n) > 1})
        raise ValueError(f"engine {meta.replica} rank {meta.rank}: tensors listed twice: {dup}")
    ids = names.many(key)
    dtype_ids = dtypes.many(list(map(_DTYPE, meta.tensors)))
    esize = np.array([dtype_size(d) for d in dtypes.values], dtype=np.int64)[dtype_ids]
    numels = np.fromiter(map(math.prod, map(_SHAPE, meta.tensors)), np.int64, count=len(key))
    return ids, esize * numels, dtype_ids


def _region_column(tensors, region_ids: dict[RegionDesc, int]) -> np.ndarray:
    """Region id of each tensor (one region per rank is the rule: no hashing per tensor)."""
    regions = list(map(_REGION, tensors))
    if regions and regions.count(regions[0]) == len(regions):  # identity first: C speed
        rid = region_ids.setdefault(regions[0], len(region_ids))
        return np.full(len(regions), rid, dtype=np.int64)
    for r in dict.fromkeys(regions):
        region_ids.setdefault(r, len(region_ids))
    return np.fromiter((region_ids[r] for r in regions), np.int64, len(regions))


_NAME = operator.attrgetter("name")
_NAME_SHAPE_DTYPE = operator.attrgetter("name", "shape", "dtype")
_SHAPE = operator.attrgetter("shape")
_OFFSET = operator.attrgetter("offset")
_REGION = operator.attrgetter("region")
_DTYPE = operator.attrgetter("dtype")


def grow_lookup(table: EngineTable, n_names: int) -> np.ndarray:
    """``table.lookup`` widened to ``n_names`` columns (names interned after the table)."""
    have = table.lookup.shape[1]
    if n_names <= have:
        return table.lookup
    pad = np.full((table.lookup.shape[0], n_names - have), -1, dtype=np.int64)
    return np.concatenate([table.lookup, pad], axis=1)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PieceTable:
    """Columns of a piece list: source param index, destination name id, offset, bytes."""

    param: np.ndarray
    name: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    dtype: np.ndarray


def piece_table(
    pieces: Sequence[Piece], param_index: Mapping[str, int], names: Interner, dtypes: Interner
) -> PieceTable:
    """Columns of ``pieces``; a source parameter the trainer lacks is a ValueError."""
    n = len(pieces)
    try:
        param = np.fromiter(map(param_index.__getitem__, map(_SRC, pieces)), np.int64, count=n)
    except KeyError:
        missing = sorted({p.src_param for p in pieces if p.src_param not in param_index})
        shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise ValueError(
            f"{len(missing)} source parameter(s) of engine pieces are not trainer "
            f"parameters: {shown}"
        ) from None
    return PieceTable(
        param=param,
        name=names.many(list(map(_DST, pieces))),
        offset=np.fromiter(map(_DST_OFFSET, pieces), np.int64, count=n),
        nbytes=np.fromiter(map(_NBYTES, pieces), np.int64, count=n),
        dtype=dtypes.many(list(map(_DST_DTYPE, pieces))),
    )


_SRC = operator.attrgetter("src_param")
_DST = operator.attrgetter("dst_tensor")
_DST_OFFSET = operator.attrgetter("dst_offset")
_NBYTES = operator.attrgetter("nbytes")
_DST_DTYPE = operator.attrgetter("dst_dtype")
