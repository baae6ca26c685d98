"""``compute_plan``: gathered metadata in, a validated-ready :class:`~scheduling.plan.Plan` out.

The one entry point of planning, pure and deterministic: match engine tensors
to trainer parameters (:mod:`scheduling.build.match`), then assign and order the
tasks (:mod:`scheduling.build.build`)::

    plan = compute_plan(trainer_meta, engine_metas, cluster, model=cfg)
    plan.validate()                      # every destination byte written exactly once
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduling.build.build import build_plan
from scheduling.build.match import match_engines
from scheduling.cluster.config import ClusterConfig
from scheduling.plan import Plan
from weight_transfer.layout.shard_geometry import gc_paused
from weight_transfer.types import EngineRankMeta, TrainerMeta


def compute_plan(
    trainer_meta: TrainerMeta,
    engine_metas: Iterable[EngineRankMeta],
    cluster: ClusterConfig,
    *,
    model: object,
    fp8: bool | None = None,
    expert_naming: str = "per_expert",
    ignore: Iterable[str] = (),
    pieces_per_nic: int = 32,
    min_piece_bytes: int = 1 << 20,
    max_piece_bytes: int = 256 << 20,
    gather_order: str = "interleaved",
    gather: str = "shard_direct",
) -> Plan:
    """Match engine tensors to trainer parameters and build the plan. Pure, deterministic.

    ``model`` is the :class:`~weight_transfer.model.models.ModelConfig`; ``fp8``
    defaults to the cluster's ``inference.fp8``. Pieces larger than the
    balance granularity (a group's bytes per sending NIC / ``pieces_per_nic``,
    clamped to [``min_piece_bytes``, ``max_piece_bytes``]) are split first.
    ``gather_order`` is ``"interleaved"`` (destinations alternate, the default)
    or ``"canonical"`` (the trainer metadata's order). ``gather`` is
    ``"shard_direct"`` (a parameter whose pieces its ranks' own shards cover is
    written from them with no collective, :mod:`scheduling.build.direct`) or ``"full"``
    (every parameter gathered before it is written).
    """
    with gc_paused():  # ~10^6 acyclic objects: GC passes over them would cost seconds
        engines = tuple(engine_metas)
        fp8 = cluster.inference.fp8 if fp8 is None else fp8
        pieces = match_engines(
            model,
            trainer_meta,
            engines,
            fp8=fp8,
            expert_naming=expert_naming,
            ignore=tuple(ignore),
        )
        return build_plan(
            trainer_meta,
            engines,
            pieces,
            pieces_per_nic=pieces_per_nic,
            min_piece_bytes=min_piece_bytes,
            max_piece_bytes=max_piece_bytes,
            gather_order=gather_order,
            gather=gather,
        )
