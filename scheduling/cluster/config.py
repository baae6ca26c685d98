"""Cluster descriptions: trainer and inference GPUs, their NICs and the trainer meshes.

A cluster YAML (``configs/clusters/*.yaml``) says how many trainer nodes and
GPUs there are, which NIC each GPU sends through and how fast it is, how the
trainer lays its parameters out (dense FSDP over every rank, or HSDP:
replicated over ``replicate`` groups of contiguous ranks and sharded inside
each; experts spread over ``expert_parallel`` disjoint meshes), and how many inference replicas
there are, each with its TP/EP degrees, nodes and NICs::

    cfg = load_cluster_config("configs/clusters/local_cpu.yaml")
    cfg.trainer_world, cfg.rank_info(3), cfg.expert_meshes()
    cfg.dense_mesh(), cfg.dense_placements()   # 1-D FSDP or 2-D HSDP
    cfg.engine_rank(replica=1, local=0)   # -> (node, nic, ShardSpec)

Files are validated at the boundary: unknown keys, wrong types and
inconsistent counts raise ``ValueError`` naming the file and the field.
Nothing here needs torch or Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from scheduling.cluster.megatron import MegatronLayout, check_world
from weight_transfer.config_files import FieldError, StrictModel, load_yaml, validate_mapping
from weight_transfer.types import MeshDesc, NicId, Placement, RankInfo, ShardSpec

_SHARD0 = Placement(kind="shard", dim=0)
_REPLICATE = Placement(kind="replicate")


def _default_gpu_nic(gpus: int, nics: int) -> tuple[int, ...]:
    # GPUs are spread evenly: with 8 GPUs and 4 NICs, GPUs 0-1 use NIC 0, 2-3 NIC 1 ...
    return tuple(g * nics // gpus for g in range(gpus))


def _check_gpu_nic(gpu_nic: tuple[int, ...] | None, gpus: int, nics: int) -> None:
    if gpu_nic is None:
        return
    if len(gpu_nic) != gpus:
        raise ValueError(f"gpu_nic has {len(gpu_nic)} entries but a node has {gpus} GPUs")
    bad = [n for n in gpu_nic if not 0 <= n < nics]
    if bad:
        raise ValueError(f"gpu_nic names NICs {bad} outside [0, {nics})")


class TrainerCluster(StrictModel):
    """Training side: ``nodes`` x ``gpus_per_node`` ranks, rank = node * gpus_per_node + gpu."""

    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    nics_per_node: int = Field(ge=1)
    nic_gbps: float = Field(gt=0, description="line rate of one NIC in Gb/s")
    gpu_nic: tuple[int, ...] | None = Field(
        default=None, description="NIC index used by each local GPU (default: spread evenly)"
    )
    expert_parallel: int = Field(
        default=1, ge=1, description="experts are spread over this many disjoint meshes"
    )
    expert_mesh_layout: Literal["strided", "contiguous"] = Field(
        default="strided",
        description="strided: mesh k = ranks r with r % ep == k (EP innermost, as torchtitan); "
        "contiguous: mesh k = a contiguous block of world/ep ranks",
    )
    replicate: int = Field(
        default=1, ge=1,
        description="HSDP: dense parameters replicated over this many groups of contiguous "
        "ranks and sharded inside each (1: FSDP over every rank)",
    )
    megatron: MegatronLayout | None = Field(
        default=None, description="a Megatron trainer's TP/PP/EP layout "
        "(scheduling/cluster/megatron.py); None: FSDP (the fields above)")

    @model_validator(mode="after")
    def _check(self) -> TrainerCluster:
        _check_gpu_nic(self.gpu_nic, self.gpus_per_node, self.nics_per_node)
        world = self.nodes * self.gpus_per_node
        if self.megatron is not None:
            fsdp = sorted({"expert_parallel", "expert_mesh_layout", "replicate"}
                          & self.model_fields_set)
            if fsdp:
                raise FieldError(f"{fsdp[0]} lays out an FSDP trainer; with megatron set, "
                                 "say the layout in megatron (expert_parallel there)")
            if (why := check_world(self.megatron, world)) is not None:
                raise FieldError(why)
        if world % self.expert_parallel:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} does not divide the {world} trainer ranks"
            )
        if world % self.replicate:
            raise ValueError(
                f"replicate={self.replicate} does not divide the {world} trainer ranks"
            )
        return self


class InferenceCluster(StrictModel):
    """Inference side: ``replicas`` engines of ``gpus_per_replica`` GPUs (TP x EP)."""

    replicas: int = Field(ge=1)
    gpus_per_replica: int = Field(ge=1)
    tensor_parallel: int = Field(ge=1)
    expert_parallel: int = Field(default=1, ge=1)
    nodes_per_replica: int = Field(default=1, ge=1)
    nics_per_node: int = Field(ge=1)
    nic_gbps: float = Field(gt=0, description="line rate of one NIC in Gb/s")
    gpu_nic: tuple[int, ...] | None = None
    fp8: bool = Field(default=False, description="engines hold FP8 block-quantized weights")
    # Shadow mode (TransferConfig.apply="shadow") needs one more copy of a rank's weights.
    memory_gib: float | None = Field(
        default=None, gt=0, description="device memory of one engine GPU, GiB (None: unknown)")
    reserved_gib: float = Field(
        default=0.0, ge=0,
        description="memory an engine GPU keeps besides its weights (KV cache, activations), GiB")
    device_copy_gbps: float | None = Field(
        default=None, gt=0,
        description="device-to-device copy rate of an engine GPU, GB/s (a shadow flip); "
        "None: not modelled")

    @property
    def gpus_per_node(self) -> int:
        return self.gpus_per_replica // self.nodes_per_replica

    @model_validator(mode="after")
    def _check(self) -> InferenceCluster:
        if self.tensor_parallel != self.gpus_per_replica:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} must equal gpus_per_replica="
                f"{self.gpus_per_replica} (one TP rank per GPU)"
            )
        if self.gpus_per_replica % self.expert_parallel:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} does not divide gpus_per_replica="
                f"{self.gpus_per_replica}"
            )
        if self.gpus_per_replica % self.nodes_per_replica:
            raise ValueError(
                f"nodes_per_replica={self.nodes_per_replica} does not divide gpus_per_replica="
                f"{self.gpus_per_replica}"
            )
        _check_gpu_nic(self.gpu_nic, self.gpus_per_node, self.nics_per_node)
        return self


class SimConfig(StrictModel):
    """Knobs of the discrete-event model in :mod:`scheduling.sim.simulate`."""

    max_inflight: int = Field(default=8, ge=1, description="writes in flight per trainer rank")
    write_latency_us: float = Field(default=0.0, ge=0, description="fixed cost of one write")
    # The stages before the NIC (scheduling/sim/stages.py); None = not modelled (free).
    h2d_gbps: float | None = Field(
        default=None, gt=0, description="host-to-device copy, GB/s per rank (None: on device)")
    intra_node_gbps: float | None = Field(
        default=None, gt=0, description="all-gather link inside a node (NVLink), GB/s per rank")
    inter_node_gbps: float | None = Field(
        default=None, gt=0,
        description="all-gather link across nodes, GB/s per rank (None: the trainer NIC rate)")
    gather_latency_us: float = Field(default=0.0, ge=0, description="latency of one ring hop")
    gathers: bool = Field(default=True, description="model full_tensor() all-gathers at all")
    delta_diff_gbps: float | None = Field(
        default=None, gt=0,
        description="sparse deltas: diff + encode against the kept bytes, GB/s of engine bytes "
                    "per trainer rank (None: free)")
    delta_apply_gbps: float | None = Field(
        default=None, gt=0,
        description="sparse deltas: the engine's apply at finish (base digest, scatter, result "
                    "digest), GB/s of engine bytes per engine rank (None: free)")
    fp8_quant_gbps: float | None = Field(
        default=None, gt=0, description="FP8 block quantization, GB/s of source bytes per rank")
    copy_gbps: float | None = Field(
        default=None, gt=0, description="cut/cast copies into staging, GB/s per rank")
    watermark_bytes: int = Field(
        default=1 << 30, ge=1, description="temporary bytes in flight per rank (executor)")
    # Fixed costs the executor pays whatever the bytes
    # (actors/tools/bench/calibrate.py measures them).
    param_overhead_us: float = Field(
        default=0.0, ge=0,
        description="per parameter and rank: a pipeline item's Python cost and its gather call")
    write_overhead_us: float = Field(
        default=0.0, ge=0, description="sender CPU time of one write, not overlapped with others")
    # The pipeline's items, as the executor cuts them (weight_transfer/sender/buckets.py).
    gather_mode: Literal["bucket", "param"] = Field(
        default="bucket",
        description="the executor's gather_unit: coalesced buckets or one per param")
    bucket_bytes: int = Field(
        default=64 << 20, ge=1,
        description="executor bucket_bytes (capped at a quarter of watermark_bytes, as there)")
    # Contention: the CPU work of every trainer rank on shared cores (a CPU-only host).
    cpu_cores: float | None = Field(
        default=None, gt=0,
        description="cores every trainer rank's CPU work shares (None: a device per rank)")
    write_copy_gbps: float | None = Field(
        default=None, gt=0,
        description="sender CPU copy of written bytes, GB/s (simnic; None: the NIC reads memory)")


class ClusterConfig(StrictModel):
    """A whole cluster; see the module docstring. Build with :func:`load_cluster_config`."""

    name: str
    description: str = ""
    trainer: TrainerCluster
    inference: InferenceCluster
    sim: SimConfig = SimConfig()
    _source: str = PrivateAttr(default="")

    @property
    def source(self) -> str:
        """The file this description was read from ("" when built in code): errors name it."""
        return self._source

    # ------------------------------------------------------------------ trainer side

    @property
    def trainer_world(self) -> int:
        return self.trainer.nodes * self.trainer.gpus_per_node

    def trainer_nics(self) -> list[str]:
        """Names of every trainer NIC, index = node * nics_per_node + nic."""
        t = self.trainer
        return [str(NicId(node=f"tnode{n}", index=j))
                for n in range(t.nodes) for j in range(t.nics_per_node)]

    def trainer_nic_index(self, rank: int) -> int:
        t = self.trainer
        if not 0 <= rank < self.trainer_world:
            raise ValueError(f"trainer rank {rank} outside [0, {self.trainer_world})")
        node, gpu = divmod(rank, t.gpus_per_node)
        gpu_nic = t.gpu_nic or _default_gpu_nic(t.gpus_per_node, t.nics_per_node)
        return node * t.nics_per_node + gpu_nic[gpu]

    def rank_info(self, rank: int) -> RankInfo:
        t = self.trainer
        nic = NicId(node=f"tnode{rank // t.gpus_per_node}",
                    index=self.trainer_nic_index(rank) % t.nics_per_node)
        return RankInfo(rank=rank, node=nic.node, nic=str(nic))

    def rank_infos(self) -> tuple[RankInfo, ...]:
        return tuple(self.rank_info(r) for r in range(self.trainer_world))

    def dense_mesh(self) -> MeshDesc:
        """FSDP over every trainer rank, or with ``replicate`` > 1 the 2-D HSDP mesh
        ``(replicate, world // replicate)``: replica group i = ranks i*S .. i*S+S-1."""
        world, rep = self.trainer_world, self.trainer.replicate
        if rep == 1:
            return MeshDesc(ranks=tuple(range(world)), shape=(world,), dim_names=("dp_shard",))
        return MeshDesc(ranks=tuple(range(world)), shape=(rep, world // rep),
                        dim_names=("dp_replicate", "dp_shard"))

    def dense_placements(self) -> tuple[Placement, ...]:
        """Placements of dense parameters on :meth:`dense_mesh`: ``(Shard(0),)`` or, with
        HSDP, ``(Replicate(), Shard(0))``."""
        if self.trainer.replicate == 1:
            return (_SHARD0,)
        return (_REPLICATE, _SHARD0)

    def expert_meshes(self) -> list[MeshDesc]:
        """The ``expert_parallel`` disjoint meshes; mesh k holds experts of EP rank k."""
        ep, world = self.trainer.expert_parallel, self.trainer_world
        size = world // ep
        meshes = []
        for k in range(ep):
            if self.trainer.expert_mesh_layout == "strided":
                ranks = tuple(range(k, world, ep))
            else:
                ranks = tuple(range(k * size, (k + 1) * size))
            meshes.append(MeshDesc(ranks=ranks, shape=(size,), dim_names=("dp_shard_in_ep",)))
        return meshes

    def stacked_expert_mesh(self) -> tuple[MeshDesc, tuple[Placement, ...]]:
        """Mesh and placements of experts stacked in one 3-D parameter (EP x FSDP)."""
        ep, world = self.trainer.expert_parallel, self.trainer_world
        if self.trainer.expert_mesh_layout == "strided":
            ranks = tuple(r for k in range(ep) for r in range(k, world, ep))
        else:
            ranks = tuple(range(world))
        mesh = MeshDesc(ranks=ranks, shape=(ep, world // ep), dim_names=("ep", "dp_shard_in_ep"))
        return mesh, (Placement(kind="shard", dim=0), Placement(kind="shard", dim=1))

    def expert_mesh_index(self, expert: int, num_experts: int) -> int:
        """Which expert mesh owns ``expert`` (contiguous blocks of experts per EP rank)."""
        ep = self.trainer.expert_parallel
        if num_experts % ep:
            raise ValueError(
                f"cluster {self.name!r}: trainer expert_parallel={ep} does not divide "
                f"the model's {num_experts} experts"
            )
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} outside [0, {num_experts})")
        return expert // (num_experts // ep)

    # ------------------------------------------------------------------ inference side

    @property
    def engine_world(self) -> int:
        return self.inference.replicas * self.inference.gpus_per_replica

    def engine_nics(self) -> list[str]:
        """Names of every inference NIC, index = node * nics_per_node + nic."""
        i = self.inference
        nodes = i.replicas * i.nodes_per_replica
        return [str(NicId(node=f"inode{n}", index=j))
                for n in range(nodes) for j in range(i.nics_per_node)]

    def replica_name(self, replica: int) -> str:
        return f"engine{replica}"

    def shard_of(self, local: int) -> ShardSpec:
        i = self.inference
        per_ep = i.gpus_per_replica // i.expert_parallel
        return ShardSpec(
            tp_rank=local,
            tp_size=i.tensor_parallel,
            ep_rank=local // per_ep,
            ep_size=i.expert_parallel,
        )

    def engine_nic(self, replica: int, local: int) -> NicId:
        """The NIC of local rank ``local`` of replica ``replica`` (what an engine actor
        passes to ``wt_attach_engine(nics=[...])``)."""
        i = self.inference
        if not (0 <= replica < i.replicas and 0 <= local < i.gpus_per_replica):
            raise ValueError(
                f"engine rank (replica={replica}, local={local}) outside "
                f"{i.replicas} replicas x {i.gpus_per_replica} GPUs"
            )
        node_in_replica, gpu = divmod(local, i.gpus_per_node)
        node = replica * i.nodes_per_replica + node_in_replica
        gpu_nic = i.gpu_nic or _default_gpu_nic(i.gpus_per_node, i.nics_per_node)
        return NicId(node=f"inode{node}", index=gpu_nic[gpu])

    def engine_rank(self, replica: int, local: int) -> tuple[str, str, ShardSpec]:
        """(node, nic, shard) of local rank ``local`` of replica ``replica``."""
        nic = self.engine_nic(replica, local)
        return nic.node, str(nic), self.shard_of(local)

    # ------------------------------------------------------------------ bandwidth

    @property
    def send_bytes_per_s(self) -> float:
        return self.trainer.nic_gbps * 1e9 / 8

    @property
    def recv_bytes_per_s(self) -> float:
        return self.inference.nic_gbps * 1e9 / 8


def cluster_from_dict(data: object, *, source: str = "<dict>") -> ClusterConfig:
    """Validate a parsed mapping; errors name ``source`` and the field."""
    cluster = validate_mapping(ClusterConfig, data, kind="cluster", source=source)
    cluster._source = "" if source == "<dict>" else source
    return cluster


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster YAML file (``cluster.source`` names it)."""
    cluster = load_yaml(ClusterConfig, path, kind="cluster")
    cluster._source = str(path)
    return cluster
