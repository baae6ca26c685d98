"""A trainer rank's plan checked against its own parameters, before it replaces the last.

``check_trainer_plan(plan, params)`` runs on the rank that received the plan
(``weight_transfer.plan.wire.loads_trainer_plan`` already checked the blob's own
fields): every parameter it gathers or writes from its own shard (``local``)
is one of the rank's, every task belongs to the rank and the group it sits
in, reads a parameter of that group, and its source rectangle lies inside
that parameter, and for a local parameter inside the block (or the flat range) this
rank holds (:func:`weight_transfer.layout.shard_blocks.holds`). It returns the tasks grouped
by mesh group and parameter, as :class:`~weight_transfer.sender.executor.RankTransfer`
replays them::

    groups = check_trainer_plan(plan, param_metas)   # ValueError naming rank, group, task
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from weight_transfer.layout.fp8_geometry import scale_shape
from weight_transfer.layout.shard_blocks import held, holds
from weight_transfer.plan.types import TrainerPlan
from weight_transfer.types import ParamMeta, Piece, Transform, WriteTask, dtype_size


@dataclass(frozen=True, slots=True)
class GroupWork:
    """One mesh group on this rank: parameters in gather order, tasks by parameter, and the
    shard-direct parameters it writes from its own shard (no collective), in order."""

    group: int
    params: tuple[ParamMeta, ...]
    tasks: dict[str, list[WriteTask]]
    local: tuple[ParamMeta, ...] = ()


def check_trainer_plan(plan: TrainerPlan, params: Sequence[ParamMeta]) -> list[GroupWork]:
    """Validate a rank's plan against the parameter metadata; group its tasks by parameter.

    ``plan`` has ``rank`` and ``groups``, each with ``group``, ``params`` (names,
    gather order) and ``tasks`` (``WriteTask``), as ``weight_transfer.plan.types.TrainerPlan``.
    """
    metas = {p.name: p for p in params}
    out = []
    for g in plan.groups:
        local = tuple(getattr(g, "local", ()))
        missing = [n for n in (*g.params, *local) if n not in metas]
        if missing:
            raise ValueError(f"rank {plan.rank} group {g.group}: unknown parameters {missing[:10]}")
        tasks: dict[str, list[WriteTask]] = collections.defaultdict(list)
        for t in g.tasks:
            if t.src_rank != plan.rank or t.mesh_group != g.group:
                raise ValueError(
                    f"rank {plan.rank} group {g.group}: task {t.task_id} belongs to rank "
                    f"{t.src_rank} group {t.mesh_group}"
                )
            tasks[t.piece.src_param].append(t)
            _check_slice(t, metas.get(t.piece.src_param), plan.rank)
        stray = sorted(set(tasks) - set(g.params) - set(local))
        if stray:
            raise ValueError(
                f"rank {plan.rank} group {g.group}: tasks read parameters the rank never "
                f"gathers: {stray[:10]}"
            )
        for name in local:
            _check_local(tasks.get(name, []), metas[name], plan.rank)
        out.append(GroupWork(g.group, tuple(metas[n] for n in g.params), dict(tasks),
                             tuple(metas[n] for n in local)))
    return out


def _check_local(tasks: list[WriteTask], meta: ParamMeta, rank: int) -> None:
    """Each task of a shard-direct parameter reads inside the block (or flat range) this
    rank holds."""
    for t in tasks:
        sl = t.piece.src_slice
        if any(a >= b for a, b in sl) or not holds(meta, rank, sl):
            raise ValueError(
                f"rank {rank} task {t.task_id}: source slice {sl} of {meta.name!r} is not "
                f"inside the block the rank holds ({held(meta, rank)}); "
                "it cannot be written without a gather")


def _check_slice(task: WriteTask, meta: ParamMeta | None, rank: int) -> None:
    """The task's source rectangle lies inside its parameter (else prepare would read past
    it or fail mid-update, after other writes landed)."""
    if meta is None:
        return  # reported with the other stray parameters
    sl = task.piece.src_slice
    if len(sl) != len(meta.shape) or any(not 0 <= a < b <= d
                                         for (a, b), d in zip(sl, meta.shape, strict=False)):
        raise ValueError(f"rank {rank} task {task.task_id}: source slice {sl} is not inside "
                         f"parameter {meta.name!r} of shape {meta.shape}")


def expected_piece_nbytes(piece: Piece) -> int:
    """Bytes that ``piece.transform`` of its source rectangle produces."""
    shape = piece.src_shape
    if piece.transform == Transform.FP8_SCALE:
        if len(shape) < 2:
            raise ValueError(f"piece {piece.dst_tensor}: FP8 scales need a 2-D source, {shape}")
        shape = scale_shape(shape)
    return math.prod(shape) * dtype_size(piece.dst_dtype)
