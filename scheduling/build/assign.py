"""Pure assignment steps of the plan: mesh groups, gather order, source ranks, task order.

Everything here works on plain integers and numpy arrays, so it is tested with
tables of small cases and runs on a million tasks in well under a second:

1. :func:`mesh_groups` - meshes (as rank sets) packed into groups of pairwise
   disjoint meshes; the largest (dense) mesh first. Groups run one after the
   other with a barrier between them; meshes of one group run in parallel.
2. :func:`interleave_order` - the order in which a mesh gathers its parameters
   (``full_tensor()`` is a collective: every rank of the mesh must issue it in
   the same order). Parameters going to different destination shards are
   interleaved in proportion to their bytes, so at any moment the mesh sends to
   every destination instead of one engine rank after another.
3. :func:`assign_sources` - each task (in gather order) goes to one rank of its
   mesh: greedy on the least-loaded sending NIC, in batches of one task per NIC,
   largest task to the least-loaded NIC. Every rank of a mesh holds the full
   tensor after the gather, so any of them can send; the receiving NIC is fixed
   by the destination, so only the sending side is chosen here.
4. :func:`spread_order` - each trainer's tasks within one parameter are rotated
   over destination NICs by the trainer's position in its mesh, so the ranks of
   a mesh do not all start on the same destination NIC.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mesh_groups(meshes: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of ``meshes`` packed into groups of pairwise disjoint meshes.

    First fit, larger meshes first (ties: the earlier mesh), so the dense mesh
    over every rank forms group 0. Meshes must be distinct rank sets.
    """
    sets = [frozenset(m) for m in meshes]
    if len(set(sets)) != len(sets):
        raise ValueError("mesh_groups needs distinct rank sets; merge equal meshes first")
    order = sorted(range(len(sets)), key=lambda i: (-len(sets[i]), i))
    groups: list[list[int]] = []
    used: list[set[int]] = []
    for i in order:
        for members, ranks in zip(groups, used, strict=True):
            if ranks.isdisjoint(sets[i]):
                members.append(i)
                ranks.update(sets[i])
                break
        else:
            groups.append([i])
            used.append(set(sets[i]))
    return groups


def interleave_order(signature: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Positions of items (in their natural order) reordered by proportional merge.

    Items with the same ``signature`` (e.g. the same set of destination shards)
    keep their relative order; streams of different signatures advance in
    proportion to their bytes: an item's key is the fraction of its stream's
    bytes sent before its midpoint. Ties keep the natural order.
    """
    signature = np.asarray(signature)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = len(signature)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    _, inv = np.unique(signature, return_inverse=True)
    by_sig = np.argsort(inv, kind="stable")
    sorted_bytes = nbytes[by_sig]
    cum = np.cumsum(sorted_bytes)
    totals = np.bincount(inv, weights=nbytes)
    starts = np.concatenate(([0.0], np.cumsum(totals)[:-1]))
    sig_sorted = inv[by_sig]
    before = cum - sorted_bytes - starts[sig_sorted]
    denom = np.where(totals[sig_sorted] > 0, totals[sig_sorted], 1.0)
    frac = np.empty(n)
    frac[by_sig] = (before + sorted_bytes / 2) / denom
    return np.lexsort((np.arange(n), frac))


def _greedy_batches(
    nbytes: np.ndarray, bins: np.ndarray, load: np.ndarray, out: np.ndarray
) -> None:
    """Put items (in order) into ``bins``, batch by batch, largest item to lightest bin.

    Batches are rows of a matrix (the last one padded with empty items, which land
    on the heaviest bins and add nothing): the item order of every batch is one
    vectorized sort, and only the bin order, which depends on the loads so far,
    is sorted batch by batch (ties: the order of ``bins``; items: input order).
    """
    k, n = len(bins), len(nbytes)
    if n == 0:
        return
    rows = -(-n // k)
    sizes = np.zeros(rows * k, dtype=np.int64)
    sizes[:n] = nbytes
    sizes = sizes.reshape(rows, k)
    by_size = np.argsort(-sizes, axis=1, kind="stable")
    sizes = np.take_along_axis(sizes, by_size, axis=1)
    bin_load = load[bins].astype(np.int64)
    slot = np.empty((rows, k), dtype=np.int64)
    argsort = bin_load.argsort  # the method: no dispatch wrapper in this hot loop
    for i in range(rows):
        lightest = argsort(kind="stable")
        slot[i] = lightest
        bin_load[lightest] += sizes[i]
    load[bins] = bin_load
    pos = (np.arange(rows, dtype=np.int64)[:, None] * k + by_size).ravel()
    keep = pos < n
    out[pos[keep]] = bins[slot.ravel()[keep]]


def greedy_batches_many(jobs: Sequence[tuple[np.ndarray, np.ndarray]], load: np.ndarray,
                        outs: Sequence[np.ndarray]) -> None:
    """:func:`_greedy_batches` of several jobs ``(nbytes, bins)`` at once, batch ``r`` of
    every job in one vectorized step. The jobs' bins must be disjoint (their loads never
    meet), so the result is what running them one after the other gives."""
    if not jobs:
        return
    ks = [len(b) for _, b in jobs]
    k, rows = max(ks), max(-(-len(n) // kk) for (n, _), kk in zip(jobs, ks, strict=True))
    rows = max(rows, 1)
    sizes = np.zeros((len(jobs), rows, k), dtype=np.int64)
    bin_load = np.full((len(jobs), k), np.iinfo(np.int64).max // 2, dtype=np.int64)
    for m, ((nbytes, bins), kk) in enumerate(zip(jobs, ks, strict=True)):
        flat = np.zeros(-(-len(nbytes) // kk) * kk, dtype=np.int64)
        flat[: len(nbytes)] = nbytes
        sizes[m, : len(flat) // kk, :kk] = flat.reshape(-1, kk)
        bin_load[m, :kk] = load[bins]  # padding bins: never the lightest
    by_size = np.argsort(-sizes, axis=2, kind="stable")
    sizes = np.take_along_axis(sizes, by_size, axis=2)
    slot = np.empty((len(jobs), rows, k), dtype=np.int64)
    flat_load = bin_load.ravel()  # a view: row m's bins at m * k ...
    base = (np.arange(len(jobs), dtype=np.int64) * k)[:, None]
    for r in range(rows):
        lightest = bin_load.argsort(axis=1, kind="stable")
        slot[:, r] = lightest
        flat_load[lightest + base] += sizes[:, r]  # a permutation per row: no repeats
    for m, ((nbytes, bins), kk, out) in enumerate(zip(jobs, ks, outs, strict=True)):
        load[bins] = bin_load[m, :kk]
        pos = (np.arange(rows, dtype=np.int64)[:, None] * kk + by_size[m]).ravel()
        keep = (by_size[m].ravel() < kk) & (pos < len(nbytes))
        out[pos[keep]] = bins[slot[m].ravel()[keep]]


def assign_sources(
    nbytes: np.ndarray,
    ranks: Sequence[int],
    rank_nic: np.ndarray,
    nic_load: np.ndarray,
    rank_load: np.ndarray,
) -> np.ndarray:
    """Source rank for each task of one mesh, tasks given in gather order.

    ``ranks`` are the mesh's ranks, ``rank_nic[r]`` the sending NIC of rank
    ``r``. ``nic_load`` and ``rank_load`` (bytes, indexed by NIC and rank) are
    updated in place, so meshes of one group can share NICs. Deterministic.
    """
    nbytes = np.asarray(nbytes, dtype=np.int64)
    ranks_arr = np.asarray(ranks, dtype=np.int64)
    if len(ranks_arr) == 0:
        raise ValueError("cannot assign tasks to an empty mesh")
    nics = np.unique(rank_nic[ranks_arr])
    task_nic = np.empty(len(nbytes), dtype=np.int64)
    _greedy_batches(nbytes, nics, nic_load, task_nic)
    mesh_nics = rank_nic[ranks_arr]
    if len(nics) == len(ranks_arr):  # one mesh rank per NIC: the NIC names the rank
        lookup = np.empty(int(nics.max()) + 1, dtype=np.int64)
        lookup[mesh_nics] = ranks_arr
        src = lookup[task_nic]
        np.add.at(rank_load, src, nbytes)
        return src
    src = np.empty(len(nbytes), dtype=np.int64)
    for nic in nics:
        mine = np.flatnonzero(task_nic == nic)
        chosen = np.empty(len(mine), dtype=np.int64)
        _greedy_batches(nbytes[mine], np.sort(ranks_arr[mesh_nics == nic]), rank_load, chosen)
        src[mine] = chosen
    return src


def spread_order(
    src: np.ndarray,
    major: np.ndarray,
    dst_nic: np.ndarray,
    rotation: np.ndarray,
    n_dst_nics: int,
) -> np.ndarray:
    """Permutation ordering tasks by (src, major, rotated destination NIC).

    ``major`` is an integer key that must stay in order (mesh group and gather
    position, combined by the caller). Within equal (src, major), a task's
    destination NIC index counts from its ``rotation`` (derived from the
    sender's position in its mesh), so the ranks of a mesh start on different
    NICs; ties keep the input order.
    """
    if n_dst_nics <= 0:
        raise ValueError("n_dst_nics must be positive")
    rotated = (np.asarray(dst_nic, dtype=np.int64) - np.asarray(rotation)) % n_dst_nics
    return np.lexsort((np.arange(len(src)), rotated, np.asarray(major), np.asarray(src)))
