"""Planning steps of shard-direct pieces (:mod:`scheduling.build.direct`) inside ``build_plan``.

1. :func:`direct_pieces` - per distinct engine shard, replace every piece of a
   shard-direct parameter by its parts (:func:`scheduling.build.direct.cover_piece`),
   each tagged with the index of its set of source ranks (``owner sets``);
   pieces of gathered parameters keep the tag -1. A parameter is shard-direct
   when every piece of it, on every shard, is covered, and its owners would not
   each write it in many small writes (counting the engine ranks that hold each
   shard: :data:`scheduling.build.direct.MAX_OWNER_WRITES`). Pieces of a
   gathered parameter are left as they came, so a plan where no parameter is
   direct has exactly the pieces and tasks of ``gather="full"``.
2. :func:`assign_direct` - sources of the tasks of shard-direct pieces, before
   the gathered tasks of the same mesh group: a task with one owner goes to it,
   a task with several (HSDP replicas) to the least-loaded sending NIC among
   them (:func:`scheduling.build.assign.assign_sources`), so the gathered tasks that
   follow fill what ownership left unbalanced::

    raw, tags, owner_sets, direct, fallback = direct_pieces(raw, params, index, "shard_direct",
                                                         copies)
    assign_direct(rows, task_owner, nbytes, owner_sets, rank_nic, nic_load, rank_load, src)
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from scheduling.build.assign import assign_sources
from scheduling.build.direct import (
    MAX_OWNER_WRITES,
    WRITE_COST_BYTES,
    check_gather_mode,
    cover_parts,
    cut_piece,
)
from weight_transfer.types import ParamMeta, Piece

log = logging.getLogger(__name__)


def direct_pieces(raw: Sequence[Sequence[Piece]], params: Sequence[ParamMeta],
                  index: Mapping[str, int], mode: str, copies: Sequence[int] | None = None):
    """(pieces per shard, owner-set tag per piece per shard, owner sets, direct flag per
    parameter, ``(param index, reason)`` of each parameter gathered in shard-direct mode).
    ``copies``: engine ranks holding each shard (1 each if not given)."""
    check_gather_mode(mode)
    direct = np.zeros(len(params), dtype=bool)
    if mode == "full":
        return ([list(ps) for ps in raw], [np.full(len(ps), -1, dtype=np.int64) for ps in raw],
                [], direct, ())
    covers, reasons = _covers(raw, params, index)
    used = set().union(*(ids for ids, _ in covers)) - {None}
    reasons.update(_fan_out(covers, [1] * len(raw) if copies is None else copies, reasons))
    direct[sorted(used - set(reasons))] = True
    flags = direct.tolist()
    owner_ids: dict[tuple[int, ...], int] = {}
    out, tags = [], []
    for ps, (ids, row) in zip(raw, covers, strict=True):
        pieces = list(ps)
        tag = np.full(len(ps), -1, dtype=np.int64)
        hits = [k for k, i in enumerate(ids) if i is not None and flags[i]]
        if hits:  # rebuild the row: gathered pieces as they are, direct ones cut
            pieces, ks = [], []
            last = 0
            for k in hits:
                pieces.extend(ps[last:k])
                ks.extend([-1] * (k - last))
                for part, owners in cut_piece(ps[k], row[k]):
                    pieces.append(part)
                    ks.append(owner_ids.setdefault(owners, len(owner_ids)))
                last = k + 1
            pieces.extend(ps[last:])
            ks.extend([-1] * (len(ps) - last))
            tag = np.asarray(ks, dtype=np.int64)
        out.append(pieces)
        tags.append(tag)
    fallback = tuple(sorted(reasons.items()))
    if fallback:
        top = Counter(r for _, r in fallback).most_common(3)
        log.info("shard-direct: %d of %d parameters direct; %d gathered, most for: %s",
                 int(direct.sum()), len(used), len(fallback), "; ".join(r for r, _ in top))
    return out, tags, list(owner_ids), direct, fallback


def _covers(raw: Sequence[Sequence[Piece]], params: Sequence[ParamMeta],
            index: Mapping[str, int]):
    """(per shard: each piece's parameter index or None, and its parts or None; the
    reason each refused parameter is gathered, from its first piece not covered). Once
    a parameter is refused its other pieces are not looked at (it is gathered whole);
    pieces with the same source and parameter geometry (every expert of a layer) share
    one answer."""
    memo: dict[tuple, tuple | str] = {}
    reasons: dict[int, str] = {}
    covers = []
    get = index.get
    for ps in raw:
        ids = [get(p.src_param) for p in ps]
        row: list[tuple | None] = [None] * len(ps)
        for k, i in enumerate(ids):
            if i is None or i in reasons:
                continue
            piece, meta = ps[k], params[i]
            key = (id(meta.mesh), meta.shape, meta.placements, piece.src_slice,
                   piece.transform, piece.dst_dtype, piece.nbytes)
            got = memo.get(key)
            if got is None:
                got = memo[key] = cover_parts(piece, meta)
            if isinstance(got, str):
                reasons[i] = got
            else:
                row[k] = got
        covers.append((ids, row))
    return covers, reasons


def _fan_out(covers, copies: Sequence[int], refused: Mapping[int, str]) -> dict[int, str]:
    """Parameters whose owners would each write them in more than ``MAX_OWNER_WRITES``
    small writes (see :data:`scheduling.build.direct.MAX_OWNER_WRITES`), and why."""
    writes: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    owners: dict[int, set[int]] = {}
    stats: dict[int, tuple[int, int, frozenset[int]]] = {}  # id(parts) -> its sums
    for (ids, row), c in zip(covers, copies, strict=True):
        for i, parts in zip(ids, row, strict=True):
            if parts is None or i in refused:
                continue
            st = stats.get(id(parts))
            if st is None:
                st = stats[id(parts)] = (len(parts), sum(p[2] for p in parts),
                                         frozenset(r for p in parts for r in p[3]))
            writes[i] = writes.get(i, 0) + st[0] * int(c)
            nbytes[i] = nbytes.get(i, 0) + st[1] * int(c)
            owners.setdefault(i, set()).update(st[2])
    out = {}
    for i, w in writes.items():
        per_owner = w / len(owners[i])
        if per_owner > MAX_OWNER_WRITES and nbytes[i] < WRITE_COST_BYTES * w:
            out[i] = (f"its {len(owners[i])} owners would write it in {w} writes of "
                      f"{nbytes[i] // w} B on average ({per_owner:.0f} each, > "
                      f"{MAX_OWNER_WRITES} under {WRITE_COST_BYTES} B): one gather is cheaper")
    return out


def assign_direct(rows: np.ndarray, task_owner: np.ndarray, nbytes: np.ndarray,
                  owner_sets: Sequence[tuple[int, ...]], rank_nic: np.ndarray,
                  nic_load: np.ndarray, rank_load: np.ndarray, src: np.ndarray) -> None:
    """Sources of the shard-direct tasks ``rows`` (see the module docstring); loads in place."""
    if len(rows) == 0:
        return
    sizes = np.array([len(s) for s in owner_sets], dtype=np.int64)
    first = np.array([s[0] for s in owner_sets], dtype=np.int64)
    owner = task_owner[rows]
    single = sizes[owner] == 1
    one = rows[single]
    src[one] = first[owner[single]]
    np.add.at(rank_load, src[one], nbytes[one])
    np.add.at(nic_load, rank_nic[src[one]], nbytes[one])
    many = rows[~single]
    order = np.argsort(task_owner[many], kind="stable")
    many = many[order]
    keys = task_owner[many]
    bounds = np.flatnonzero(np.diff(keys)) + 1
    for part in np.split(many, bounds):
        if len(part):
            src[part] = assign_sources(nbytes[part], owner_sets[int(task_owner[part[0]])],
                                       rank_nic, nic_load, rank_load)
