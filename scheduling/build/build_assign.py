"""Source ranks of a plan's tasks (step 4 of :mod:`scheduling.build.build`), per mesh group.

Tasks come in gather order. Per mesh group (each balanced on its own: a barrier
separates groups) the shard-direct tasks are assigned first, to their owners
(:func:`scheduling.build.direct_assign.assign_direct`), then the gathered tasks by
:func:`scheduling.build.assign.assign_sources` per mesh run, from the loads the
shard-direct ones left; meshes of one group that share no NIC are assigned at
once (:func:`scheduling.build.assign.greedy_batches_many`)::

    src, rotation = assign_tasks(task_piece, piece_table, trainers, n_recv_nics,
                                 (task_owner, owner_sets))
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from scheduling.build.assign import assign_sources, greedy_batches_many
from scheduling.build.direct_assign import assign_direct
from scheduling.build.tables import PieceTable


def assign_tasks(task_piece: np.ndarray, pt: PieceTable, tr: Any, n_recv_nics: int,
            owners: tuple[np.ndarray, list]):
    """Source rank and spread rotation of every task; tasks come in gather order.

    ``owners``: each task's owner-set tag (-1: gathered) and the owner sets. Per mesh
    group, shard-direct tasks are assigned first (:func:`assign_direct`), the gathered
    ones then fill in from the loads they left."""
    param_mesh, mesh_group, meshes, rank_nic = tr.param_mesh, tr.mesh_group, tr.meshes, tr.rank_nic
    task_owner, owner_sets = owners
    n = len(task_piece)
    task_mesh = param_mesh[pt.param[task_piece]]
    task_group = mesh_group[task_mesh]
    nbytes = pt.nbytes[task_piece]
    src = np.empty(n, dtype=np.int64)
    rotation = np.empty(n, dtype=np.int64)
    gathered = np.flatnonzero(task_owner < 0)
    sub_mesh = task_mesh[gathered]
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(sub_mesh)) + 1, [len(gathered)]))
    runs = {}  # group -> runs (a, b, mesh) over ``gathered``
    for a, b in itertools.pairwise(bounds):
        if a < b:
            runs.setdefault(int(mesh_group[sub_mesh[a]]), []).append((a, b, int(sub_mesh[a])))
    nic_load = np.zeros(int(rank_nic.max()) + 1, dtype=np.int64)
    rank_load = np.zeros(len(rank_nic), dtype=np.int64)
    sub_bytes, sub_src = nbytes[gathered], np.empty(len(gathered), dtype=np.int64)
    # each group is balanced on its own (barrier between): loads start at zero per group
    for g in sorted(set(task_group.tolist())):
        nic_load[:] = 0
        rank_load[:] = 0
        assign_direct(np.flatnonzero((task_owner >= 0) & (task_group == g)), task_owner,
                      nbytes, owner_sets, rank_nic, nic_load, rank_load, src)
        group_runs = runs.get(g, [])
        if _independent(group_runs, meshes, rank_nic):
            _assign_together(group_runs, sub_bytes, meshes, rank_nic, nic_load, rank_load,
                             sub_src)
        else:
            for a, b, m in group_runs:
                sub_src[a:b] = assign_sources(sub_bytes[a:b], meshes[m].ranks, rank_nic,
                                              nic_load, rank_load)
    src[gathered] = sub_src
    for m, mesh in enumerate(meshes):
        sel = np.flatnonzero(task_mesh == m)
        pos = np.zeros(len(rank_nic), dtype=np.int64)
        pos[list(mesh.ranks)] = np.arange(len(mesh.ranks))
        rotation[sel] = pos[src[sel]] * n_recv_nics // len(mesh.ranks)
    return src, rotation


def _independent(runs, meshes, rank_nic) -> bool:
    """Whether runs can be assigned at once with the same result as one after the other:
    one run per mesh, one mesh rank per NIC, no NIC shared between the meshes."""
    seen: set[int] = set()
    for _, _, m in runs:
        nics = set(rank_nic[list(meshes[m].ranks)].tolist())
        if len(nics) != len(meshes[m].ranks) or not seen.isdisjoint(nics):
            return False
        seen |= nics
    return len({m for _, _, m in runs}) == len(runs)


def _assign_together(runs, nbytes, meshes, rank_nic, nic_load, rank_load, src) -> None:
    """:func:`assign_sources` of independent runs (:func:`_independent`), batch by batch
    over all of them at once: the same greedy, far fewer Python steps."""
    jobs, outs, lookups = [], [], []
    for a, b, m in runs:
        ranks = np.asarray(meshes[m].ranks, dtype=np.int64)
        nics = np.unique(rank_nic[ranks])
        lookup = np.empty(int(nics.max()) + 1, dtype=np.int64)
        lookup[rank_nic[ranks]] = ranks
        jobs.append((nbytes[a:b], nics))
        outs.append(np.empty(b - a, dtype=np.int64))
        lookups.append(lookup)
    greedy_batches_many(jobs, nic_load, outs)
    for (a, b, _), out, lookup in zip(runs, outs, lookups, strict=True):
        src[a:b] = lookup[out]
        np.add.at(rank_load, src[a:b], nbytes[a:b])
