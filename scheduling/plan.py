"""The static transfer plan as data: who writes which bytes where, in which order.

:func:`scheduling.compute.compute_plan` builds a :class:`Plan` from gathered
metadata, once; this module only holds the plan's types and their accessors::

    plan.validate()                      # every destination byte written exactly once
    tp = plan.trainer_plan(rank)         # what trainer ``rank`` receives (see serialize)
    plan.send_bytes(), plan.recv_bytes() # bytes per mesh group and NIC

A plan is flat: unique :class:`Piece` objects (shared by all replicas of a
shard), unique regions, and one row per task in numpy columns, ordered by
(source rank, mesh group, gather position, destination spread). Mesh groups
run in order with a barrier between them; meshes of one group run in parallel.
Every rank of a mesh gathers (``full_tensor()``) the mesh's parameters in the
order of ``group_params`` and writes the tasks it was assigned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduling.build.validate import validate_plan
from weight_transfer.layout.zero_copy import zero_copy_span
from weight_transfer.plan.types import TrainerGroup, TrainerPlan
from weight_transfer.types import (
    EngineRankMeta,
    MeshDesc,
    ParamMeta,
    Piece,
    RankInfo,
    RegionDesc,
    WriteTask,
)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Plan:
    """A computed plan; task columns are numpy arrays (see the module docstring)."""

    params: tuple[ParamMeta, ...]
    trainer_ranks: tuple[RankInfo, ...]
    engines: tuple[EngineRankMeta, ...]
    pieces: tuple[Piece, ...]
    regions: tuple[RegionDesc, ...]
    send_nics: tuple[str, ...]
    recv_nics: tuple[str, ...]
    meshes: tuple[MeshDesc, ...]
    mesh_group: tuple[int, ...]
    param_mesh: tuple[int, ...]  # scheduling mesh of each param
    group_params: tuple[tuple[int, ...], ...]  # gather order of each group (param indices)
    task_piece: np.ndarray
    task_src: np.ndarray
    task_dst: np.ndarray
    task_region: np.ndarray
    task_offset: np.ndarray
    task_group: np.ndarray
    trainer_ptr: np.ndarray  # tasks of rank r: rows trainer_ptr[r]:trainer_ptr[r + 1]
    # "full": every parameter gathered; "shard_direct": see scheduling.build.direct
    gather: str = "full"
    # params written from their owners' shards with no collective (indices, ascending)
    direct_params: tuple[int, ...] = ()
    # shard_direct: (param index, why it is gathered) of every gathered parameter
    fallback: tuple[tuple[int, str], ...] = ()

    # ------------------------------------------------------------------ sizes

    @property
    def num_tasks(self) -> int:
        return len(self.task_piece)

    @property
    def num_groups(self) -> int:
        return len(self.group_params)

    def task_nbytes(self) -> np.ndarray:
        sizes = np.fromiter((p.nbytes for p in self.pieces), np.int64, count=len(self.pieces))
        return sizes[self.task_piece]

    @property
    def bytes_total(self) -> int:
        return int(self.task_nbytes().sum())

    def send_nic_of_task(self) -> np.ndarray:
        nic_idx = {n: i for i, n in enumerate(self.send_nics)}
        rank_nic = np.array([nic_idx[r.nic] for r in self.trainer_ranks], dtype=np.int64)
        return rank_nic[self.task_src]

    def recv_nic_of_task(self) -> np.ndarray:
        nic_idx = {n: i for i, n in enumerate(self.recv_nics)}
        engine_nic = np.array([nic_idx[e.nic] for e in self.engines], dtype=np.int64)
        return engine_nic[self.task_dst]

    def _per_nic(self, nic_of_task: np.ndarray, n_nics: int) -> np.ndarray:
        key = self.task_group.astype(np.int64) * n_nics + nic_of_task
        counts = np.bincount(key, weights=self.task_nbytes(), minlength=self.num_groups * n_nics)
        return counts.astype(np.int64).reshape(self.num_groups, n_nics)

    def send_bytes(self) -> np.ndarray:
        """Bytes sent per (mesh group, trainer NIC)."""
        return self._per_nic(self.send_nic_of_task(), len(self.send_nics))

    def recv_bytes(self) -> np.ndarray:
        """Bytes received per (mesh group, engine NIC)."""
        return self._per_nic(self.recv_nic_of_task(), len(self.recv_nics))

    def param_direct(self) -> np.ndarray:
        """Per parameter: whether its ranks write it from their shards (no collective)."""
        out = np.zeros(len(self.params), dtype=bool)
        out[list(self.direct_params)] = True
        return out

    def task_direct(self) -> np.ndarray:
        """Per task: whether it is written from its source rank's own shard."""
        index = {p.name: i for i, p in enumerate(self.params)}
        piece_param = np.fromiter((index[p.src_param] for p in self.pieces), np.int64,
                                  len(self.pieces))
        return self.param_direct()[piece_param[self.task_piece]] if self.num_tasks else \
            np.zeros(0, dtype=bool)

    def task_zero_copy(self) -> np.ndarray:
        """Per task: whether its bytes already lie in order in its source rank's own
        memory (:func:`weight_transfer.layout.zero_copy.zero_copy_span`): written from
        there with no staging copy while the source is registered and fenced."""
        if not self.num_tasks:
            return np.zeros(0, dtype=bool)
        direct = self.task_direct()
        metas = {p.name: p for p in self.params}
        out = np.zeros(self.num_tasks, dtype=bool)
        for row in np.flatnonzero(direct).tolist():
            piece = self.pieces[int(self.task_piece[row])]
            out[row] = zero_copy_span(metas[piece.src_param], piece,
                                      int(self.task_src[row])) is not None
        return out

    @property
    def param_group(self) -> dict[str, int]:
        """Mesh group of every planned parameter, by trainer name."""
        return {self.params[p].name: g for g, order in enumerate(self.group_params) for p in order}

    def gather_order(self, rank: int) -> dict[int, list[str]]:
        """Per group, the parameters ``rank`` gathers, in the order every rank of its
        mesh must use (``full_tensor()`` is a collective)."""
        return {g.group: list(g.params) for g in self.trainer_plan(rank).groups}

    # ------------------------------------------------------------------ per trainer

    def task(self, row: int) -> WriteTask:
        """Task row ``row`` as a :class:`WriteTask` (``task_id`` is the row)."""
        engine = self.engines[int(self.task_dst[row])]
        return WriteTask(
            task_id=row,
            mesh_group=int(self.task_group[row]),
            src_rank=int(self.task_src[row]),
            piece=self.pieces[int(self.task_piece[row])],
            dst_replica=engine.replica,
            dst_rank=engine.rank,
            region=self.regions[int(self.task_region[row])],
            region_offset=int(self.task_offset[row]),
        )

    def tasks_for(self, rank: int) -> list[WriteTask]:
        """Ordered tasks of trainer ``rank`` (all groups)."""
        self._check_rank(rank)
        a, b = int(self.trainer_ptr[rank]), int(self.trainer_ptr[rank + 1])
        cols = (self.task_group, self.task_piece, self.task_dst, self.task_region,
                self.task_offset)
        engines, pieces, regions = self.engines, self.pieces, self.regions
        return [
            WriteTask(task_id=row, mesh_group=g, src_rank=rank, piece=pieces[p],
                      dst_replica=engines[d].replica, dst_rank=engines[d].rank,
                      region=regions[r], region_offset=off)
            for row, g, p, d, r, off in zip(range(a, b), *(c[a:b].tolist() for c in cols),
                                           strict=True)
        ]

    def trainer_plan(self, rank: int) -> TrainerPlan:
        """What trainer ``rank`` receives: per group, its mesh, gather order and tasks."""
        tasks = self.tasks_for(rank)
        param_mesh = np.asarray(self.param_mesh, dtype=np.int64)
        direct = self.param_direct()
        groups = []
        for g, order in enumerate(self.group_params):
            mine = [m for m, mg in enumerate(self.mesh_group)
                    if mg == g and rank in self.meshes[m].ranks]
            params: tuple[str, ...] = ()
            local: tuple[str, ...] = ()
            group_tasks = tuple(t for t in tasks if t.mesh_group == g)
            if mine:
                seq = np.asarray(order, dtype=np.int64)
                seq = seq[param_mesh[seq] == mine[0]]
                params = tuple(self.params[p].name for p in seq[~direct[seq]])
                written = {t.piece.src_param for t in group_tasks}
                local = tuple(n for n in (self.params[p].name for p in seq[direct[seq]])
                              if n in written)
            groups.append(
                TrainerGroup(
                    group=g,
                    mesh=self.meshes[mine[0]] if mine else None,
                    params=params,
                    tasks=group_tasks,
                    local=local,
                )
            )
        return TrainerPlan(rank=rank, groups=tuple(groups))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self.trainer_ptr) - 1:
            raise ValueError(f"trainer rank {rank} outside [0, {len(self.trainer_ptr) - 1})")

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ValueError if any destination byte is not written exactly once, etc."""
        validate_plan(self)
