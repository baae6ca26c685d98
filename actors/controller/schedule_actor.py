"""ScheduleActor: builds the transfer plan once from gathered metadata.

It receives every trainer rank's live parameter metadata (merged here and
checked: ranks that share a parameter must agree on it), the node-aware
:class:`~weight_transfer.types.RankInfo` of every trainer rank, and every
engine rank's registered regions; computes the plan with
:func:`scheduling.compute_plan`, validates it (every destination byte written
exactly once) and returns one msgpack blob per trainer plus summary numbers::

    sched = ScheduleActor.remote(model_cfg, cluster, fp8=False)
    result = ray.get(sched.plan.remote(trainer_metas, rank_infos, engine_metas))
    result.blobs[r]          # what trainer r replays at every update
    result.summary           # bytes, tasks, groups, replicas per rank, bytes per NIC

The plan stays in the actor (``plan_blob()`` returns all of it, msgpack);
nothing is recomputed per update, only when the set of replicas changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import ray

from actors.messages import PlanResult, PlanSummary, TrainerRankMeta, check_trainer_metas
from scheduling import Plan, compute_plan
from scheduling.build.direct import check_gather_mode
from scheduling.cluster.config import ClusterConfig
from scheduling.serialize import dumps_plan
from weight_transfer.integrity.receipt import check_engine_meta
from weight_transfer.model.models import ModelConfig
from weight_transfer.plan.wire import dumps_trainer_plan
from weight_transfer.types import EngineRankMeta, ParamMeta, RankInfo, TrainerMeta

log = logging.getLogger(__name__)


def merge_trainer_metas(metas: Sequence[TrainerRankMeta]) -> tuple[tuple[ParamMeta, ...], str]:
    """Every parameter once (first-seen order) and the trainers' expert naming.

    ValueError if ranks are missing or repeated, disagree on a parameter or on
    the expert naming, or a parameter is missing on a rank of its mesh.
    """
    if not metas:
        raise ValueError("no trainer metadata gathered")
    world = metas[0].world
    ranks = sorted(m.rank for m in metas)
    if ranks != list(range(world)) or any(m.world != world for m in metas):
        raise ValueError(f"trainer metadata from ranks {ranks}; expected each of 0..{world - 1}")
    namings = {m.expert_naming for m in metas}
    if len(namings) != 1:
        raise ValueError(f"trainer ranks disagree on expert naming: {sorted(namings)}")
    merged: dict[str, tuple[ParamMeta, int]] = {}
    holders: dict[str, set[int]] = {}
    for m in sorted(metas, key=lambda m: m.rank):
        for p in m.params:
            prev = merged.setdefault(p.name, (p, m.rank))
            if prev[0] != p:
                raise ValueError(
                    f"trainer ranks {prev[1]} and {m.rank} disagree on parameter {p.name!r}: "
                    f"{prev[0].shape} {prev[0].dtype} mesh {prev[0].mesh.ranks} vs "
                    f"{p.shape} {p.dtype} mesh {p.mesh.ranks}"
                )
            holders.setdefault(p.name, set()).add(m.rank)
    for name, (p, _) in merged.items():
        missing = sorted(set(p.mesh.ranks) - holders[name])
        if missing:
            raise ValueError(f"parameter {name!r} lives on mesh {p.mesh.ranks} but ranks "
                             f"{missing} did not report it")
    return tuple(p for p, _ in merged.values()), namings.pop()


def summarize(plan: Plan, *, plan_id: int, seconds: float, expert_naming: str) -> PlanSummary:
    """Numbers of a plan: bytes per rank, replica and NIC; replicas each rank writes to."""
    nbytes = plan.task_nbytes()
    replica_of_engine = np.array([e.replica for e in plan.engines], dtype=object)
    replicas = tuple(dict.fromkeys(e.replica for e in plan.engines))
    by_rank, replicas_by_rank, regions_by_rank, dest_bytes = {}, {}, {}, {}
    for r in range(len(plan.trainer_ranks)):
        a, b = int(plan.trainer_ptr[r]), int(plan.trainer_ptr[r + 1])
        by_rank[r] = int(nbytes[a:b].sum())
        replicas_by_rank[r] = tuple(sorted(set(replica_of_engine[plan.task_dst[a:b]].tolist())))
        regions = (plan.regions[i] for i in sorted(set(plan.task_region[a:b].tolist())))
        regions_by_rank[r] = tuple((g.owner, g.nic, g.addr) for g in regions)
        per_engine = np.bincount(plan.task_dst[a:b], weights=nbytes[a:b],
                                 minlength=len(plan.engines))  # exact below 2**53 B
        dest: dict[str, dict[int, int]] = {}
        for e in np.flatnonzero(per_engine).tolist():
            eng = plan.engines[e]
            dest.setdefault(eng.replica, {})[eng.rank] = int(per_engine[e])
        dest_bytes[r] = dest
    by_replica = {name: 0 for name in replicas}
    for name, n in zip(replica_of_engine[plan.task_dst].tolist(), nbytes.tolist(), strict=True):
        by_replica[name] += int(n)
    send, recv = plan.send_bytes().sum(axis=0), plan.recv_bytes().sum(axis=0)
    return PlanSummary(
        plan_id=plan_id,
        bytes_total=plan.bytes_total,
        num_tasks=plan.num_tasks,
        num_groups=plan.num_groups,
        replicas=replicas,
        trainer_ranks=plan.trainer_ranks,
        bytes_by_rank=by_rank,
        replicas_by_rank=replicas_by_rank,
        bytes_by_replica=by_replica,
        send_nic_bytes={n: int(b) for n, b in zip(plan.send_nics, send, strict=True)},
        recv_nic_bytes={n: int(b) for n, b in zip(plan.recv_nics, recv, strict=True)},
        plan_seconds=seconds,
        expert_naming=expert_naming,
        regions_by_rank=regions_by_rank,
        gather=plan.gather,
        direct_bytes=int(nbytes[plan.task_direct()].sum()) if plan.num_tasks else 0,
        gathered_params=len(plan.fallback),
        dest_bytes_by_rank=dest_bytes,
        zero_copy_bytes=int(nbytes[plan.task_zero_copy()].sum()) if plan.num_tasks else 0,
    )


class Scheduler:
    """The schedule actor's logic (``ScheduleActor`` is this class as a Ray actor)."""

    def __init__(self, model: ModelConfig, cluster: ClusterConfig, *, fp8: bool,
                 gather: str = "shard_direct") -> None:
        self.model, self.cluster, self.fp8 = model, cluster, fp8
        self.gather = check_gather_mode(gather)
        self._plan: Plan | None = None
        self.plans_computed = 0

    def plan(
        self,
        trainer_metas: Sequence[TrainerRankMeta],
        rank_infos: Sequence[RankInfo],
        engine_metas: Sequence[EngineRankMeta],
    ) -> PlanResult:
        """Merge, plan, validate; one blob per trainer rank and the summary."""
        start = time.perf_counter()
        check_trainer_metas(trainer_metas)  # on receipt, as the controller did
        for i, m in enumerate(engine_metas):
            check_engine_meta(m, f"engine metadata {i}")
        params, naming = merge_trainer_metas(trainer_metas)
        if [r.rank for r in rank_infos] != list(range(len(trainer_metas))):
            raise ValueError(f"rank infos of ranks {[r.rank for r in rank_infos]} do not match "
                             f"the {len(trainer_metas)} trainer ranks")
        meta = TrainerMeta(params=params, ranks=tuple(rank_infos))
        plan = compute_plan(meta, list(engine_metas), self.cluster, model=self.model,
                            fp8=self.fp8, expert_naming=naming, gather=self.gather)
        plan.validate()
        blobs = tuple(dumps_trainer_plan(plan.trainer_plan(r)) for r in range(len(rank_infos)))
        self._plan = plan
        self.plans_computed += 1
        seconds = time.perf_counter() - start
        summary = summarize(plan, plan_id=self.plans_computed, seconds=seconds,
                            expert_naming=naming)
        log.info("plan %d: %d tasks, %d B, %d mesh groups, %d replicas in %.3f s; gather=%s, "
                 "%d B shard-direct (%.1f%%), %d B gathered (%d parameters), send NICs "
                 "max/mean %.3f",
                 summary.plan_id, summary.num_tasks, summary.bytes_total, summary.num_groups,
                 len(summary.replicas), seconds, summary.gather, summary.direct_bytes,
                 100 * summary.direct_bytes / max(summary.bytes_total, 1),
                 summary.gathered_bytes, summary.gathered_params, summary.send_imbalance)
        return PlanResult(blobs=blobs, summary=summary)

    def plan_blob(self) -> bytes:
        """The whole current plan (``scheduling.serialize.loads_plan`` reads it)."""
        if self._plan is None:
            raise RuntimeError("no plan computed yet")
        return dumps_plan(self._plan)

    def count(self) -> int:
        return self.plans_computed


ScheduleActor = ray.remote(num_cpus=0)(Scheduler)
