"""Build a :class:`~scheduling.plan.Plan` from trainer metadata, engine metadata and pieces.

``build_plan`` is the second half of :func:`scheduling.compute.compute_plan`
(after :mod:`scheduling.build.match`): it takes the pieces of each distinct engine
shard (replicas with the same shard share them) and

1. groups the trainer meshes (:func:`scheduling.build.assign.mesh_groups`);
2. splits pieces larger than the group's balance granularity;
3. fixes each mesh's gather order (:func:`scheduling.build.assign.interleave_order`,
   or the trainer metadata's order with ``gather_order="canonical"``);
4. expands pieces into tasks (one per engine rank holding the shard), in
   gather order, and assigns each a source rank of its mesh
   (:func:`scheduling.build.assign.assign_sources`);
5. resolves each task's region and offset from the engine metadata;
6. orders each trainer's tasks (:func:`scheduling.build.assign.spread_order`).

Everything per task is numpy; Python loops run over distinct pieces, params
and meshes only::

    plan = build_plan(trainer_meta, engine_metas, {shard: pieces, ...})
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from scheduling.build.assign import interleave_order, mesh_groups, spread_order
from scheduling.build.build_assign import assign_tasks
from scheduling.build.direct_assign import direct_pieces
from scheduling.build.tables import PieceTable, engine_table, grow_lookup, piece_table
from scheduling.plan import Plan
from weight_transfer.layout.engine_layout import split_piece
from weight_transfer.plan.wire import Interner
from weight_transfer.types import EngineRankMeta, MeshDesc, ParamMeta, Piece, ShardSpec, TrainerMeta

log = logging.getLogger(__name__)

SplitFn = Callable[[Piece, int], list[Piece]]
# interleaved: params of different destination shards alternate (see assign.interleave_order);
# canonical: the order of the trainer metadata.
GATHER_ORDERS = ("interleaved", "canonical")


def _param_index(params: Sequence[ParamMeta]) -> dict[str, int]:
    index = {p.name: i for i, p in enumerate(params)}
    if len(index) != len(params):
        seen: set[str] = set()
        for p in params:
            if p.name in seen:
                raise ValueError(f"trainer parameter {p.name!r} listed twice")
            seen.add(p.name)
    return index


def _scheduling_meshes(params: Sequence[ParamMeta]) -> tuple[list[MeshDesc], list[int]]:
    """Meshes with the same rank set are one scheduling mesh (same collective peers)."""
    by_set: dict[frozenset[int], int] = {}
    by_obj: dict[int, int] = {}  # params usually share MeshDesc objects: skip re-hashing
    meshes: list[MeshDesc] = []
    param_mesh = []
    for p in params:
        m = by_obj.get(id(p.mesh))
        if m is None:
            key = frozenset(p.mesh.ranks)
            if key not in by_set:
                by_set[key] = len(meshes)
                meshes.append(p.mesh)
            m = by_obj[id(p.mesh)] = by_set[key]
        param_mesh.append(m)
    return meshes, param_mesh


def _trainer_nics(meta: TrainerMeta, meshes: Sequence[MeshDesc]) -> tuple[list[str], np.ndarray]:
    ranks = sorted(meta.ranks, key=lambda r: r.rank)
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise ValueError(f"trainer ranks must be 0..{len(ranks) - 1} once each")
    nics: dict[str, int] = {}
    rank_nic = np.array([nics.setdefault(r.nic, len(nics)) for r in ranks], dtype=np.int64)
    for m in meshes:
        bad = [r for r in m.ranks if not 0 <= r < len(ranks)]
        if bad:
            raise ValueError(f"mesh {m.ranks} names trainer ranks {bad} with no RankInfo")
    return list(nics), rank_nic


def _shards(
    engines: Sequence[EngineRankMeta], pieces_by_shard: Mapping[ShardSpec, Sequence[Piece]]
) -> tuple[list[ShardSpec], list[list[int]]]:
    """Distinct shards (first appearance) and the engine indices holding each."""
    shards: dict[ShardSpec, list[int]] = {}
    for e, meta in enumerate(engines):
        shards.setdefault(meta.shard, []).append(e)
    missing = [s for s in shards if s not in pieces_by_shard]
    if missing:
        raise ValueError(f"no pieces given for engine shards {missing}")
    return list(shards), list(shards.values())


def _granularity(
    bytes_per_group: np.ndarray, nics_per_group: np.ndarray, per_nic: int, lo: int, hi: int
) -> np.ndarray:
    target = bytes_per_group / np.maximum(nics_per_group, 1) / max(per_nic, 1)
    return np.clip(target, lo, hi).astype(np.int64)


def _split_pieces(
    pieces: Sequence[Piece], limit: np.ndarray, split: SplitFn
) -> tuple[list[Piece], list[Piece], np.ndarray, np.ndarray]:
    """(all pieces after splitting, the new ones, origin: raw index or -1 for new ones,
    parent: the raw index each piece comes from)."""
    out: list[Piece] = []
    new: list[Piece] = []
    origin: list[int] = []
    parent: list[int] = []
    big = np.flatnonzero(np.fromiter((p.nbytes for p in pieces), np.int64, len(pieces)) > limit)
    last = 0
    for i in big.tolist():
        parts = split(pieces[i], int(limit[i]))
        out.extend(pieces[last:i])
        origin.extend(range(last, i))
        parent.extend(range(last, i))
        out.extend(parts)
        new.extend(parts)
        origin.extend([-1] * len(parts))
        parent.extend([i] * len(parts))
        last = i + 1
    out.extend(pieces[last:])
    origin.extend(range(last, len(pieces)))
    parent.extend(range(last, len(pieces)))
    return out, new, np.asarray(origin, dtype=np.int64), np.asarray(parent, dtype=np.int64)


def _merge_tables(raw: PieceTable, new: PieceTable, origin: np.ndarray) -> PieceTable:
    """Columns of the split list: raw rows where unchanged, new rows in order elsewhere."""
    fresh = origin < 0
    cols = {}
    for f in ("param", "name", "offset", "nbytes", "dtype"):
        col = np.empty(len(origin), dtype=np.int64)
        col[~fresh] = getattr(raw, f)[origin[~fresh]]
        col[fresh] = getattr(new, f)
        cols[f] = col
    return PieceTable(**cols)


def _gather_order(
    groups: list[list[int]],
    param_mesh: np.ndarray,
    sig: np.ndarray,
    pbytes: np.ndarray,
    used: np.ndarray,
    interleave: bool,
) -> list[tuple[int, ...]]:
    """Per group: params of each mesh (group's mesh order) in gather order."""
    order: list[tuple[int, ...]] = []
    for members in groups:
        seq: list[int] = []
        for m in members:
            sel = np.flatnonzero((param_mesh == m) & used)
            if interleave:
                sel = sel[interleave_order(sig[sel], pbytes[sel])]
            seq.extend(sel.tolist())
        order.append(tuple(seq))
    return order


def _expand(piece_order: np.ndarray, piece_shard: np.ndarray, shard_engines: list[list[int]]):
    """Tasks (piece, engine) for each piece in order, one per engine holding its shard."""
    counts_by_shard = np.array([len(e) for e in shard_engines], dtype=np.int64)
    flat = np.array([e for es in shard_engines for e in es], dtype=np.int64)
    ptr = np.concatenate(([0], np.cumsum(counts_by_shard)))
    counts = counts_by_shard[piece_shard[piece_order]]
    task_piece = np.repeat(piece_order, counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    within = np.arange(len(task_piece), dtype=np.int64) - first
    task_dst = flat[np.repeat(ptr[piece_shard[piece_order]], counts) + within]
    return task_piece, task_dst


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Trainers:
    """The trainer side, flattened: scheduling meshes, their groups, each rank's NIC."""

    params: tuple[ParamMeta, ...]
    param_index: dict[str, int]
    meshes: list[MeshDesc]
    param_mesh: np.ndarray
    groups: list[list[int]]
    mesh_group: np.ndarray
    send_nics: list[str]
    rank_nic: np.ndarray


def _trainers(trainer_meta: TrainerMeta) -> _Trainers:
    params = tuple(trainer_meta.params)
    meshes, param_mesh = _scheduling_meshes(params)
    groups = mesh_groups([m.ranks for m in meshes])
    mesh_group = np.empty(len(meshes), dtype=np.int64)
    for g, members in enumerate(groups):
        mesh_group[members] = g
    send_nics, rank_nic = _trainer_nics(trainer_meta, meshes)
    return _Trainers(params=params, param_index=_param_index(params), meshes=meshes,
                     param_mesh=np.asarray(param_mesh, dtype=np.int64), groups=groups,
                     mesh_group=mesh_group, send_nics=send_nics, rank_nic=rank_nic)


def _split_all(tr: _Trainers, raw: list[Sequence[Piece]], tags: list[np.ndarray],
               copies: np.ndarray, names, dtypes, split: SplitFn,
               granularity: tuple[int, int, int]):
    """Split pieces above their group's granularity: (pieces, table, shard of each piece,
    owner-set tag of each piece: its raw piece's)."""
    tables = [piece_table(ps, tr.param_index, names, dtypes) for ps in raw]
    gbytes = np.zeros(len(tr.groups))
    for t, c in zip(tables, copies, strict=True):
        group = tr.mesh_group[tr.param_mesh[t.param]]
        gbytes += np.bincount(group, weights=t.nbytes * c, minlength=len(tr.groups))
    gnics = np.array([len(np.unique(tr.rank_nic[[r for m in ms for r in tr.meshes[m].ranks]]))
                      for ms in tr.groups])
    gran = _granularity(gbytes, gnics, *granularity)
    per_shard, merged, owner = [], [], []
    for ps, t, tag in zip(raw, tables, tags, strict=True):
        out, new, origin, parent = _split_pieces(ps, gran[tr.mesh_group[tr.param_mesh[t.param]]],
                                                 split)
        per_shard.append(out)
        owner.append(tag[parent])
        merged.append(_merge_tables(t, piece_table(new, tr.param_index, names, dtypes), origin))
    pieces = tuple(p for ps in per_shard for p in ps)
    piece_shard = np.repeat(np.arange(len(raw)), [len(ps) for ps in per_shard])
    pt = PieceTable(**{f: np.concatenate([getattr(t, f) for t in merged])
                       for f in ("param", "name", "offset", "nbytes", "dtype")})
    return pieces, pt, piece_shard, np.concatenate(owner) if owner else np.zeros(0, np.int64)


def _gather_positions(tr: _Trainers, pt: PieceTable, piece_shard: np.ndarray,
                      copies: np.ndarray, interleave: bool):
    """(gather order per group, each param's global gather position or -1 if unused)."""
    n_params, n_shards = len(tr.params), len(copies)
    has = np.zeros((n_params, n_shards), dtype=bool)
    has[pt.param, piece_shard] = True
    if n_shards <= 62:  # one integer per param: much faster than unique rows
        sig = has.astype(np.int64) @ np.left_shift(np.int64(1), np.arange(n_shards))
    else:
        _, sig = np.unique(has, axis=0, return_inverse=True)
    pbytes = np.bincount(pt.param, weights=pt.nbytes * copies[piece_shard], minlength=n_params)
    group_params = _gather_order(tr.groups, tr.param_mesh, sig.ravel(), pbytes,
                                 has.any(axis=1), interleave)
    gpos = np.full(n_params, -1, dtype=np.int64)
    flat = [p for seq in group_params for p in seq]
    gpos[flat] = np.arange(len(flat))
    return group_params, gpos


def build_plan(
    trainer_meta: TrainerMeta,
    engines: Sequence[EngineRankMeta],
    pieces_by_shard: Mapping[ShardSpec, Sequence[Piece]],
    *,
    pieces_per_nic: int = 32,
    min_piece_bytes: int = 1 << 20,
    max_piece_bytes: int = 256 << 20,
    split: SplitFn | None = None,
    gather_order: str = "interleaved",
    gather: str = "full",
) -> Plan:
    """See the module docstring. Deterministic in its inputs. ``gather``: ``"full"``
    (every parameter gathered) or ``"shard_direct"`` (:mod:`scheduling.build.direct`)."""
    if gather_order not in GATHER_ORDERS:
        raise ValueError(f"gather_order must be one of {GATHER_ORDERS}, not {gather_order!r}")
    t0 = time.perf_counter()
    engines = tuple(engines)
    tr = _trainers(trainer_meta)
    shards, shard_engines = _shards(engines, pieces_by_shard)
    copies = np.array([len(e) for e in shard_engines], dtype=np.int64)
    names, dtypes = Interner(), Interner()
    raw, tags, owner_sets, direct, fallback = direct_pieces(
        [pieces_by_shard[s] for s in shards], tr.params, tr.param_index, gather, copies)
    pieces, pt, piece_shard, piece_owner = _split_all(
        tr, raw, tags, copies, names, dtypes,
        split or split_piece, (pieces_per_nic, min_piece_bytes, max_piece_bytes))
    group_params, gpos = _gather_positions(tr, pt, piece_shard, copies,
                                           gather_order == "interleaved")
    piece_order = np.lexsort((np.arange(len(pieces)), gpos[pt.param]))
    task_piece, task_dst = _expand(piece_order, piece_shard, shard_engines)
    t1 = time.perf_counter()

    et = engine_table(engines, names, dtypes)
    recv_nic_ids: dict[str, int] = {}
    engine_nic = np.array([recv_nic_ids.setdefault(e.nic, len(recv_nic_ids)) for e in engines])
    task_src, rotation = assign_tasks(task_piece, pt, tr, len(recv_nic_ids),
                                 (piece_owner[task_piece], owner_sets))
    task_row = grow_lookup(et, len(names))[task_dst, pt.name[task_piece]]
    _check_rows(task_row, task_piece, task_dst, pieces, engines)
    order = _final_order(task_src, gpos[pt.param[task_piece]], engine_nic[task_dst], rotation,
                         len(recv_nic_ids))
    task_piece, task_dst, task_row = task_piece[order], task_dst[order], task_row[order]
    task_src = task_src[order]
    plan = Plan(
        params=tr.params,
        trainer_ranks=tuple(sorted(trainer_meta.ranks, key=lambda r: r.rank)),
        engines=engines,
        pieces=pieces,
        regions=et.regions,
        send_nics=tuple(tr.send_nics),
        recv_nics=tuple(recv_nic_ids),
        meshes=tuple(tr.meshes),
        mesh_group=tuple(tr.mesh_group.tolist()),
        param_mesh=tuple(tr.param_mesh.tolist()),
        group_params=tuple(group_params),
        task_piece=task_piece.astype(np.int32),
        task_src=task_src.astype(np.int32),
        task_dst=task_dst.astype(np.int32),
        task_region=et.region[task_row].astype(np.int32),
        task_offset=et.offset[task_row] + pt.offset[task_piece],
        task_group=tr.mesh_group[tr.param_mesh[pt.param[task_piece]]].astype(np.int16),
        trainer_ptr=np.searchsorted(task_src, np.arange(len(tr.rank_nic) + 1)),
        gather=gather,
        direct_params=tuple(int(i) for i in np.flatnonzero(direct)),
        fallback=fallback,
    )
    log.info("plan: %d tasks, %d pieces, %d groups; pieces and order %.2fs, assign %.2fs",
             plan.num_tasks, len(pieces), len(tr.groups), t1 - t0, time.perf_counter() - t1)
    return plan


def _check_rows(task_row, task_piece, task_dst, pieces, engines) -> None:
    bad = np.flatnonzero(task_row < 0)
    if len(bad) == 0:
        return
    lines = sorted(
        {
            f"{engines[task_dst[i]].replica} rank {engines[task_dst[i]].rank}: "
            f"{pieces[task_piece[i]].dst_tensor}"
            for i in bad[:1000]
        }
    )
    raise ValueError(
        f"{len(bad)} piece(s) write engine tensors the engine does not expose: "
        + "; ".join(lines[:20])
    )


def _final_order(src, gpos, dst_nic, rotation, n_dst_nics) -> np.ndarray:
    if len(src) == 0:
        return np.zeros(0, dtype=np.int64)
    if src.max() < (1 << 23) and gpos.max() < (1 << 24) and n_dst_nics <= (1 << 16):
        # one int64 key sorts several times faster than a 4-key lexsort
        rotated = (dst_nic.astype(np.int64) - rotation) % n_dst_nics
        key = (src.astype(np.int64) << 40) | (gpos << 16) | rotated
        return np.argsort(key, kind="stable")
    return spread_order(src, gpos, dst_nic, rotation, n_dst_nics)
