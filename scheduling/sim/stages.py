"""The stages before and around the NIC, per trainer rank and parameter, as the executor runs them.

``weight_transfer/sender/executor.py`` runs, per mesh group and per rank, the rank's
parameters in the plan's gather order through ``h2d -> prepare -> write``
under a byte watermark, then a barrier over every rank. This module replays
that with costs from the cluster's ``sim:`` section, one pipeline item of the
gather order at a time, vectorized over ranks. The items are the executor's:
gather buckets of consecutive parameters (:func:`weight_transfer.sender.buckets.plan_buckets`
with ``gather_mode`` and ``bucket_bytes``, capped at a quarter of the watermark
as the executor does), each gathered in one collective:

1. **admit**: an item enters once the bytes held by the items before
   it that are still in flight plus its own reserve (the bucket's gather
   memory + prepared pieces) fit under ``watermark_bytes`` (alone if it never fits);
2. **h2d**: the rank's local shard to the device, ``(bytes / shards) /
   h2d_gbps`` (one at a time; ``shards``: product of the Shard dims' sizes);
3. **prepare**: ``full_tensor()`` is a collective, so it starts when every
   rank of the mesh is ready; it costs one ring all-gather per Shard mesh dim
   over that dim's group (:mod:`scheduling.sim.gather`), each ``(n-1)/n *
   bytes / bw + (n-1) * latency`` (``bw``: ``intra_node_gbps`` when the
   groups sit in one node, else the slower of that and ``inter_node_gbps``,
   default the NIC; an HSDP mesh's ring runs inside a replica group); then
   the rank's own pieces are cut (``copy_gbps``) or FP8-quantized
   (``fp8_quant_gbps`` of source bytes), each distinct piece once; a
   coalesced bucket pays the hop latencies once; every parameter of the
   rank's order also pays ``param_overhead_us`` (its Python cost in the
   pipeline and in its gather, even on one rank);
4. **write**: the rank's NIC sends the parameter's writes after the previous
   parameter's (FIFO), at the rate that makes the rank's whole group take
   what the NIC model (:mod:`scheduling.sim.simulate`) says the group's NICs
   take, plus ``write_latency_us`` per write over ``max_inflight`` and
   ``write_overhead_us`` per write (sender CPU time, which does not overlap);
5. **barrier**: the group ends when its slowest rank's last write ends.

Shard-direct parameters (``plan.direct_params``, :mod:`scheduling.build.direct`) come
first in each mesh's order, as the executor runs them: one item each, no gather
and no wait for the mesh, their reserve the prepared pieces alone, and only a
rank that writes one of its pieces pays its h2d and ``param_overhead_us``.

The result per group: its seconds, and per stage the busy seconds of each rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scheduling.sim.gather import param_gathers
from weight_transfer.sender.buckets import plan_buckets, reserve_bytes
from weight_transfer.types import Transform, dtype_size

if TYPE_CHECKING:
    from scheduling.cluster.config import ClusterConfig
    from scheduling.plan import Plan

STAGES = ("h2d", "gather", "prepare", "write")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupCosts:
    """One mesh group: per (rank, position in its mesh's gather order) costs, padded."""

    ranks: np.ndarray  # trainer ranks with parameters in this group
    mesh: np.ndarray  # mesh index (0..M-1 within the group) of each of those ranks
    h2d: np.ndarray  # [R, K] seconds
    gather: np.ndarray  # [R, K] seconds (equal over a mesh)
    prepare: np.ndarray  # [R, K] seconds, param_overhead_us included
    write_bytes: np.ndarray  # [R, K]
    write_count: np.ndarray  # [R, K] writes
    reserve: np.ndarray  # [R, K] watermark bytes
    params: np.ndarray  # [R, K] parameters in each item (0: the rank has no such item)
    # [R, K] whether the item waits for every rank of its mesh (a gather); None: every item
    sync: np.ndarray | None = None
    tasks: tuple[np.ndarray, np.ndarray, np.ndarray]  # plan rows of the group, their (row, k)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTimes:
    """Outcome of :func:`run_group`, seconds from the group's start."""

    seconds: float
    busy: dict[str, np.ndarray]  # stage -> [R] busy seconds per rank
    write_start: np.ndarray  # [R, K]
    write_end: np.ndarray  # [R, K]


def _gbps(x: float | None) -> float:
    return np.inf if x is None else x * 1e9


def _param_costs(plan: Plan, cluster: ClusterConfig) -> tuple[np.ndarray, ...]:
    """Per parameter: (h2d seconds of the rank's shard, gather seconds, gather ring hops)."""
    nbytes = np.fromiter((p.nbytes for p in plan.params), np.float64, len(plan.params))
    gather, hops, held = param_gathers(plan, cluster)
    return nbytes * held / _gbps(cluster.sim.h2d_gbps), gather, hops


def _piece_costs(plan: Plan, cluster: ClusterConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per piece: (prepare seconds, trainer parameter index)."""
    sim = cluster.sim
    index = {p.name: i for i, p in enumerate(plan.params)}
    src_size = [dtype_size(p.dtype) for p in plan.params]
    quant, copy = _gbps(sim.fp8_quant_gbps), _gbps(sim.copy_gbps)
    cost = np.zeros(len(plan.pieces))
    param = np.zeros(len(plan.pieces), dtype=np.int64)
    for k, pc in enumerate(plan.pieces):
        i = index[pc.src_param]
        param[k] = i
        if pc.transform is Transform.FP8_WEIGHT:
            cost[k] = pc.nbytes * src_size[i] / quant  # one fp8 byte per source element
        elif pc.transform is Transform.COPY:
            cost[k] = pc.nbytes / copy
    return cost, param


def group_costs(plan: Plan, cluster: ClusterConfig, *, wire: np.ndarray | None = None,
                extra_prepare: np.ndarray | None = None) -> list[GroupCosts]:
    """Per mesh group, the cost arrays :func:`run_group` replays; ``wire``: bytes each
    piece puts on the wire when not the piece's own (sparse deltas), ``extra_prepare``:
    seconds each piece adds to prepare (their diff and encode)."""
    h2d_p, gather_p, hops_p = _param_costs(plan, cluster)
    direct = plan.param_direct() if hasattr(plan, "param_direct") else np.zeros(
        len(plan.params), dtype=bool)
    gather_p, hops_p = np.where(direct, 0.0, gather_p), np.where(direct, 0, hops_p)
    piece_cost, piece_param = _piece_costs(plan, cluster)
    if extra_prepare is not None:
        piece_cost = piece_cost + extra_prepare
    piece_bytes = np.fromiter((p.nbytes for p in plan.pieces), np.float64, len(plan.pieces))
    nbytes = (plan.task_nbytes() if wire is None else wire[plan.task_piece]).astype(np.float64)
    task_param = piece_param[plan.task_piece]
    src = plan.task_src.astype(np.int64)
    n_tr = len(plan.trainer_ranks)
    out = []
    for g, order in enumerate(plan.group_params):
        seqs = _sequences(plan, g, order, task_param[plan.task_group == g])
        ranks = np.array(sorted(r for seq in seqs.values() for r in seq[0]), dtype=np.int64)
        rank_row = np.full(n_tr, -1, dtype=np.int64)
        rank_row[ranks] = np.arange(len(ranks))
        seqs = {m: (r, np.concatenate([seq[direct[seq]], seq[~direct[seq]]]))
                for m, (r, seq) in seqs.items()}  # shard-direct parameters first
        items = {m: _items(plan, seq, cluster.sim, direct) for m, (_, seq) in seqs.items()}
        k_max = max((len(it[1]) for it in items.values()), default=0)
        col = np.full(len(plan.params), -1, dtype=np.int64)  # its item in its mesh's order
        shape = (len(ranks), max(k_max, 1))
        h2d, gather, reserve = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        n_params = np.zeros(shape)  # parameters per item where the rank has an item
        sync = np.zeros(shape, dtype=bool)
        mesh = np.zeros(len(ranks), dtype=np.int64)
        for m, (mesh_id, (mranks, seq)) in enumerate(seqs.items()):
            item_of, item_reserve, coalesced, local = items[mesh_id]
            rows = rank_row[list(mranks)]
            mesh[rows] = m
            col[seq] = item_of
            n_items = len(item_reserve)
            cols = np.arange(n_items)
            h2d[rows[:, None], cols] = np.bincount(item_of, h2d_p[seq], minlength=n_items)
            gather[rows[:, None], cols] = _item_gathers(gather_p[seq], hops_p[seq], item_of,
                                                        coalesced, cluster.sim)
            reserve[rows[:, None], cols] = item_reserve
            n_params[rows[:, None], cols] = np.bincount(item_of, minlength=n_items)
            sync[rows[:, None], cols] = ~local
        sel = np.flatnonzero(plan.task_group == g)
        key = rank_row[src[sel]] * shape[1] + col[task_param[sel]]
        size = shape[0] * shape[1]
        wbytes = np.bincount(key, nbytes[sel], minlength=size).reshape(shape)
        wcount = np.bincount(key, minlength=size).reshape(shape).astype(np.float64)
        idle = ~sync & (wcount == 0)  # a shard-direct item the rank writes nothing of
        h2d[idle] = 0.0
        n_params[idle] = 0.0
        # Each distinct piece a rank writes is prepared (and reserved) once.
        pkey = np.unique(key * len(plan.pieces) + plan.task_piece[sel])
        pkey_pos, pkey_piece = pkey // len(plan.pieces), pkey % len(plan.pieces)
        prep = (n_params * (cluster.sim.param_overhead_us * 1e-6)
                + np.bincount(pkey_pos, piece_cost[pkey_piece], minlength=size).reshape(shape))
        sizes = piece_bytes[pkey_piece]
        reserve += np.bincount(pkey_pos, sizes, minlength=size).reshape(shape)
        out.append(GroupCosts(ranks=ranks, mesh=mesh, h2d=h2d, gather=gather, prepare=prep,
                              write_bytes=wbytes, write_count=wcount, reserve=reserve,
                              params=n_params, sync=sync,
                              tasks=(sel, key // shape[1], key % shape[1])))
    return out


def _items(plan: Plan, seq: np.ndarray, sim, direct: np.ndarray) -> tuple[np.ndarray, ...]:
    """A mesh's pipeline items as the executor cuts them: each shard-direct parameter
    alone (they lead ``seq``), then :func:`plan_buckets`. Per parameter of ``seq`` its
    item; per item its gather reserve, whether coalesced and whether shard-direct."""
    bucket_bytes = max(1, min(sim.bucket_bytes, sim.watermark_bytes // 4))  # as the executor
    n_local = int(direct[seq].sum())
    buckets = plan_buckets([plan.params[p] for p in seq[n_local:].tolist()],
                           mode=sim.gather_mode, bucket_bytes=bucket_bytes)
    item_of = np.concatenate([np.arange(n_local), n_local + np.repeat(
        np.arange(len(buckets)), [len(b.params) for b in buckets])]).astype(np.int64)
    reserve = [0.0] * n_local + [reserve_bytes(b) for b in buckets]
    coalesced = [False] * n_local + [b.coalesced for b in buckets]
    return (item_of, np.array(reserve, dtype=np.float64), np.array(coalesced, dtype=bool),
            np.arange(n_local + len(buckets)) < n_local)


def _item_gathers(param_gather: np.ndarray, hops: np.ndarray, item_of: np.ndarray,
                  coalesced: np.ndarray, sim) -> np.ndarray:
    """Gather seconds per item: its parameters' ring all-gathers, but one collective's
    hop latencies for a coalesced bucket (one all-gather of all their bytes per ring)."""
    total = np.bincount(item_of, param_gather, minlength=len(coalesced))
    lat = hops * (sim.gather_latency_us * 1e-6)
    paid = np.bincount(item_of, lat, minlength=len(coalesced))
    once = np.zeros(len(coalesced))
    np.maximum.at(once, item_of, lat)
    return np.where(coalesced, total - paid + once, total)


def _sequences(plan: Plan, g: int, order, task_params: np.ndarray) -> dict:
    """Mesh -> (its ranks, its parameters in gather order) for group ``g``.

    Parameters written in the group but missing from ``order`` (hand-made plans)
    follow, in order of first write, on the mesh of the parameter.
    """
    seen = set(order)
    extra = [int(p) for p in dict.fromkeys(task_params.tolist()) if p not in seen]
    seqs: dict[int, tuple[tuple[int, ...], list[int]]] = {}
    for p in (*order, *extra):
        m = plan.param_mesh[p]
        seqs.setdefault(m, (plan.meshes[m].ranks, []))[1].append(p)
    return {m: (r, np.asarray(s, dtype=np.int64)) for m, (r, s) in seqs.items()}


def _admit_after(reserve: np.ndarray, watermark: float) -> np.ndarray:
    """[R, K]: index of the parameter whose write must end before k enters (-1: none).

    Parameters leave the watermark in order (writes are FIFO), so k waits for the
    last j < k such that reserve[j+1..k] no longer fits with j still held.
    """
    cum = np.concatenate([np.zeros((reserve.shape[0], 1)), np.cumsum(reserve, axis=1)], axis=1)
    dep = np.empty(reserve.shape, dtype=np.int64)
    for r in range(reserve.shape[0]):
        # smallest j with cum[k+1] - cum[j] <= watermark: params j..k fit together
        j = np.searchsorted(cum[r], cum[r, 1:] - watermark, side="left")
        j = np.minimum(j, np.arange(reserve.shape[1]))  # alone when it never fits
        dep[r] = j - 1
    return dep


def run_group(c: GroupCosts, nic_seconds: np.ndarray, *, watermark: float,
              write_overhead_s: float) -> StageTimes:
    """Replay one group (see the module docstring); ``nic_seconds`` [R]: each rank's
    NIC time for the group when nothing else limits it."""
    n_r, n_k = c.write_bytes.shape
    total = c.write_bytes.sum(axis=1)
    rate = np.divide(total, nic_seconds, out=np.full(n_r, np.inf), where=nic_seconds > 0)
    wtime = np.divide(c.write_bytes, rate[:, None]) + c.write_count * write_overhead_s
    dep = _admit_after(c.reserve, watermark)
    w_start, w_end = np.zeros((n_r, n_k)), np.zeros((n_r, n_k))
    rows = np.arange(n_r)
    admit = h2d_end = prep_end = nic_free = np.zeros(n_r)
    n_mesh = int(c.mesh.max(initial=0)) + 1
    for k in range(n_k):
        d = dep[:, k]
        released = np.where(d >= 0, w_end[rows, np.maximum(d, 0)], 0.0)
        admit = np.maximum(admit, released)
        h2d_end = np.maximum(h2d_end, admit) + c.h2d[:, k]
        ready = np.maximum(prep_end, h2d_end)
        mesh_ready = np.full(n_mesh, -np.inf)
        np.maximum.at(mesh_ready, c.mesh, ready)
        start = mesh_ready[c.mesh] if c.sync is None else np.where(  # a gather waits for all
            c.sync[:, k], mesh_ready[c.mesh], ready)
        prep_end = start + c.gather[:, k] + c.prepare[:, k]
        w_start[:, k] = np.maximum(prep_end, nic_free)
        nic_free = w_end[:, k] = w_start[:, k] + wtime[:, k]
    busy = {"h2d": c.h2d.sum(axis=1), "gather": c.gather.sum(axis=1),
            "prepare": c.prepare.sum(axis=1), "write": wtime.sum(axis=1)}
    seconds = float(w_end.max(initial=0.0)) if n_k else 0.0
    seconds = max(seconds, float(prep_end.max(initial=0.0)))
    return StageTimes(seconds=seconds, busy=busy, write_start=w_start, write_end=w_end)


def task_positions(plan: Plan, g: int, c: GroupCosts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(plan rows of group ``g``, their rank row and gather position in ``c``)."""
    return c.tasks
