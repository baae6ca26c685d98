"""The plan one trainer rank runs: its mesh groups, the parameters it gathers, its writes.

:mod:`scheduling` computes a whole plan once and hands each rank its part
(``plan.trainer_plan(rank)``); the executor (:mod:`weight_transfer.sender.executor`)
replays it every update. The types live here, beside the code that runs them, so the core
never reaches up into the planner::

    tp = loads_trainer_plan(blob)          # weight_transfer.plan.wire
    for group in tp.groups: ...            # TrainerGroup: mesh, params, local, tasks
"""

from __future__ import annotations

from dataclasses import dataclass

from weight_transfer.types import MeshDesc, WriteTask


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerGroup:
    """One mesh group as one trainer rank sees it.

    ``mesh`` is the rank's mesh in this group (``None`` if it has none: it only
    joins the barrier); ``params`` the names it gathers, in order; ``tasks``
    its writes, in order; ``local`` the shard-direct parameters it writes from
    its own shard with no collective (:mod:`scheduling.build.direct`), in order.
    A task reads a parameter of ``params`` (from the gathered tensor) or of
    ``local`` (from the rank's block of it, :mod:`weight_transfer.layout.shard_blocks`).
    """

    group: int
    mesh: MeshDesc | None
    params: tuple[str, ...]
    tasks: tuple[WriteTask, ...]
    local: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerPlan:
    """Everything one trainer rank needs to run its part of a transfer."""

    rank: int
    groups: tuple[TrainerGroup, ...]

    @property
    def tasks(self) -> list[WriteTask]:
        return [t for g in self.groups for t in g.tasks]
