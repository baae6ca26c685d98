"""Planning steps of shard-direct pieces (:mod:`scheduling.build.direct`) inside ``build_plan``.

1. :func:`direct_pieces` - per distinct engine shard, replace every piece of a
   shard-direct parameter by its parts (:func:`scheduling.build.direct.cover_piece`),
   each tagged with the index of its set of source ranks (``owner sets``);
   pieces of gathered parameters keep the tag -1. A parameter is shard-direct
   when every piece of it, on every shard, is covered.
2. :func:`assign_direct` - sources of the tasks of shard-direct pieces, before
   the gathered tasks of the same mesh group: a task with one owner goes to it,
   a task with several (HSDP replicas) to the least-loaded sending NIC among
   them (:func:`scheduling.build.assign.assign_sources`), so the gathered tasks that
   follow fill what ownership left unbalanced::

    raw, tags, owner_sets, direct, fallback = direct_pieces(raw, params, index, "shard_direct")
    assign_direct(rows, task_owner, nbytes, owner_sets, rank_nic, nic_load, rank_load, src)
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from scheduling.build.assign import assign_sources
from scheduling.build.direct import check_gather_mode, cover_piece
from weight_transfer.types import ParamMeta, Piece

log = logging.getLogger(__name__)


def direct_pieces(raw: Sequence[Sequence[Piece]], params: Sequence[ParamMeta],
                  index: Mapping[str, int], mode: str):
    """(pieces per shard, owner-set tag per piece per shard, owner sets, direct flag per
    parameter, ``(param index, reason)`` of each parameter gathered in shard-direct mode)."""
    check_gather_mode(mode)
    direct = np.zeros(len(params), dtype=bool)
    if mode == "full":
        return ([list(ps) for ps in raw], [np.full(len(ps), -1, dtype=np.int64) for ps in raw],
                [], direct, ())
    covers: list[list] = []
    reasons: dict[int, str] = {}
    for ps in raw:
        row = []
        for piece in ps:
            i = index.get(piece.src_param)
            cov = None if i is None else cover_piece(piece, params[i])
            if cov is not None and not cov.direct:
                reasons.setdefault(i, cov.reason)
            row.append((i, cov))
        covers.append(row)
    used = {i for row in covers for i, _ in row if i is not None}
    direct[sorted(used - set(reasons))] = True
    owner_ids: dict[tuple[int, ...], int] = {}
    out, tags = [], []
    for ps, row in zip(raw, covers, strict=True):
        pieces: list[Piece] = []
        tag: list[int] = []
        for piece, (i, cov) in zip(ps, row, strict=True):
            if i is None or not direct[i]:
                pieces.append(piece)
                tag.append(-1)
                continue
            for part, owners in cov.parts:
                pieces.append(part)
                tag.append(owner_ids.setdefault(owners, len(owner_ids)))
        out.append(pieces)
        tags.append(np.asarray(tag, dtype=np.int64))
    fallback = tuple(sorted(reasons.items()))
    if fallback:
        top = Counter(r for _, r in fallback).most_common(3)
        log.info("shard-direct: %d of %d parameters direct; %d gathered, most for: %s",
                 int(direct.sum()), len(used), len(fallback), "; ".join(r for r, _ in top))
    return out, tags, list(owner_ids), direct, fallback


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
