"""What the controller and the ready-made actors need to know: model, cluster, knobs.

A :class:`TransferConfig` is plain, picklable data; build it from YAML files
or from loaded configs::

    cfg = TransferConfig.from_files("configs/models/tiny_llama.yaml",
                                    "configs/clusters/local_cpu.yaml", fp8=False)
    ctl = WeightTransferController(trainers=..., engines=..., config=cfg)

``fp8=None`` takes the cluster's ``inference.fp8``. Timeouts bound each phase
the controller waits for; a phase that overruns raises naming the ranks that
did not answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from scheduling.cluster import ClusterConfig, load_cluster_config
from weight_transfer.models import ModelConfig, load_model_config


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig:
    """See the module docstring."""

    model: ModelConfig
    cluster: ClusterConfig
    fp8: bool | None = None
    pause_during_update: bool = True
    seed: int = 0
    lr: float = 1e-3
    setup_timeout_s: float = 300.0
    update_timeout_s: float = 120.0
    barrier_timeout_s: float = 60.0
    watermark_bytes: int = 1 << 30
    nic_gbps: float | None = None  # cap every simulated NIC (GB/s); None: memcpy speed
    actor_cpus: float = 0.1  # logical CPUs per actor (Ray only uses them to place actors)
    metrics: str = "auto"  # metrics backend: auto (ray inside Ray), ray, prometheus, null

    def __post_init__(self) -> None:
        for name in ("setup_timeout_s", "update_timeout_s", "barrier_timeout_s", "lr"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"TransferConfig.{name} must be positive, not {value!r}")
        if self.watermark_bytes <= 0:
            raise ValueError(
                f"TransferConfig.watermark_bytes must be positive, not {self.watermark_bytes}"
            )
        if self.nic_gbps is not None and not self.nic_gbps > 0:
            raise ValueError(f"TransferConfig.nic_gbps must be None or > 0, not {self.nic_gbps}")
        if not self.actor_cpus > 0:
            raise ValueError(f"TransferConfig.actor_cpus must be > 0, not {self.actor_cpus}")

    @classmethod
    def from_files(cls, model: str | Path, cluster: str | Path, **kwargs) -> TransferConfig:
        return cls(model=load_model_config(model), cluster=load_cluster_config(cluster), **kwargs)

    @property
    def engine_fp8(self) -> bool:
        return self.cluster.inference.fp8 if self.fp8 is None else self.fp8

    def with_replicas(self, replicas: int) -> TransferConfig:
        """The same config with the cluster's inference side grown to ``replicas``."""
        inference = self.cluster.inference.model_copy(update={"replicas": replicas})
        return replace(self, cluster=self.cluster.model_copy(update={"inference": inference}))
