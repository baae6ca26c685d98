"""Metadata for planning at scale without weights: from a model config and a cluster.

Live runs gather :class:`TrainerMeta` from the trainers' modules and
:class:`EngineRankMeta` from the engines' registered memory; both arrive in the
same types. To plan a 1T-parameter model on a laptop, these functions build
them from an architecture description instead::

    cfg = load_model_config("configs/models/kimi_k2.yaml")
    cluster = load_cluster_config("configs/clusters/perplexity_kimi_k2.yaml")
    trainer_meta = trainer_meta_from_config(cfg, cluster)
    engine_metas = engine_metas_from_config(cfg, cluster)

Trainer side: dense parameters are FSDP-sharded (``Shard(0)``) over every
rank, or HSDP-placed (``(Replicate(), Shard(0))`` on the cluster's 2-D dense
mesh) when the cluster sets ``trainer.replicate``; a per-expert parameter
lives on the expert mesh that owns its expert; stacked 3-D expert parameters
live on the 2-D (EP x FSDP) mesh over every rank. A cluster with ``trainer.megatron``
places them as a Megatron trainer does (:mod:`scheduling.megatron_metadata`).
Engine side: each rank's tensors (from ``engine_tensor_specs``) are laid out
one after the other, 256-byte aligned, in one synthetic region per rank with a
deterministic fake address and rkey.
"""

from __future__ import annotations

from scheduling.build.match import layout_specs
from scheduling.cluster.config import ClusterConfig
from scheduling.megatron_metadata import megatron_trainer_meta
from weight_transfer.layout.shard_geometry import gc_paused
from weight_transfer.model.models import ModelConfig, trainer_param_specs
from weight_transfer.types import (
    EngineRankId,
    EngineRankMeta,
    EngineTensorMeta,
    MeshDesc,
    ParamMeta,
    Placement,
    RegionDesc,
    ShardSpec,
    TrainerMeta,
)

ALIGN = 256
_FAKE_BASE = 0x7F00_0000_0000
_SHARD0 = (Placement(kind="shard", dim=0),)


def _is_stacked_expert(name: str, shape: tuple[int, ...]) -> bool:
    return ".experts." in name and len(shape) == 3


def trainer_meta_from_config(
    cfg: ModelConfig, cluster: ClusterConfig, *, expert_naming: str = "per_expert"
) -> TrainerMeta:
    """Trainer parameters of ``cfg`` placed on the cluster's meshes (see module docstring)."""
    with gc_paused():  # ~10^5 acyclic records: GC passes over them cost more than building
        if cluster.trainer.megatron is not None:
            return megatron_trainer_meta(cfg, cluster, expert_naming=expert_naming)
        return _trainer_meta(cfg, cluster, expert_naming)


def _trainer_meta(cfg: ModelConfig, cluster: ClusterConfig, expert_naming: str) -> TrainerMeta:
    dense, dense_placements = cluster.dense_mesh(), cluster.dense_placements()
    experts = cluster.expert_meshes()
    stacked_mesh, stacked_placements = cluster.stacked_expert_mesh()
    n_experts = cfg.n_experts  # a property that looks the architecture up: once, not per param
    expert_mesh = [experts[cluster.expert_mesh_index(e, n_experts)] for e in range(n_experts)]

    def place(spec) -> tuple[MeshDesc, tuple[Placement, ...]]:
        if spec.expert is not None:
            return expert_mesh[spec.expert], _SHARD0
        if _is_stacked_expert(spec.name, spec.shape):
            return stacked_mesh, stacked_placements
        return dense, dense_placements

    params = [
        ParamMeta(name=spec.name, shape=spec.shape, dtype=spec.dtype, mesh=mesh,
                  placements=placements)
        for spec in trainer_param_specs(cfg, expert_naming=expert_naming)
        for mesh, placements in (place(spec),)
    ]
    return TrainerMeta(params=tuple(params), ranks=cluster.rank_infos())


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def fake_region(*, owner: str, nic: str, node: str, index: int, length: int) -> RegionDesc:
    """A deterministic stand-in for a registered region (planning needs no memory)."""
    return RegionDesc(
        owner=owner,
        nic=nic,
        addr=_FAKE_BASE + (index << 40),
        length=length,
        rkey=(index * 2654435761 + 0x5EED) & 0xFFFFFFFF,
        transport="planning",
        node=node,
    )


def engine_metas_from_config(
    cfg: ModelConfig, cluster: ClusterConfig, *, fp8: bool | None = None
) -> list[EngineRankMeta]:
    """Every inference rank of the cluster with its tensors in one synthetic region."""
    with gc_paused():  # ~10^5 acyclic records per cluster: see trainer_meta_from_config
        return _engine_metas(cfg, cluster, cluster.inference.fp8 if fp8 is None else fp8)


def _engine_metas(cfg: ModelConfig, cluster: ClusterConfig, fp8: bool) -> list[EngineRankMeta]:
    layouts: dict[ShardSpec, tuple[list[tuple[str, tuple[int, ...], str, int]], int]] = {}
    out = []
    inf = cluster.inference
    for replica in range(inf.replicas):
        for local in range(inf.gpus_per_replica):
            node, nic, shard = cluster.engine_rank(replica, local)
            if shard not in layouts:
                rows, offset = [], 0
                for s in layout_specs(cfg, shard, fp8=fp8):
                    rows.append((s.name, s.shape, s.dtype, offset))
                    offset = _align(offset + s.nbytes)
                layouts[shard] = (rows, max(offset, ALIGN))
            rows, length = layouts[shard]
            name = cluster.replica_name(replica)
            region = fake_region(
                owner=str(EngineRankId(replica=name, rank=local)),
                nic=nic,
                node=node,
                index=replica * inf.gpus_per_replica + local,
                length=length,
            )
            tensors = tuple([
                EngineTensorMeta(name=n, shape=shape, dtype=dt, region=region, offset=off)
                for n, shape, dt, off in rows
            ])
            out.append(
                EngineRankMeta(
                    replica=name, rank=local, node=node, nic=nic, shard=shard, tensors=tensors
                )
            )
    return out
