"""What the controller and the ready-made actors need to know: model, cluster, knobs.

A :class:`TransferConfig` is plain, picklable data; build it from YAML files
or from loaded configs::

    cfg = TransferConfig.from_files("configs/models/tiny_llama.yaml",
                                    "configs/clusters/local_cpu.yaml", fp8=False)
    ctl = WeightTransferController(trainers=..., engines=..., config=cfg)

``fp8=None`` takes the cluster's ``inference.fp8``. Timeouts bound each phase
the controller waits for; a phase that overruns raises naming the ranks that
did not answer.

``transport`` names the data plane every trainer and engine NIC uses
(``simnic``, the default, within one host; ``mooncake``; ``rdma``) and
``transport_options`` its options, checked here against that transport's typed
options (:mod:`weight_transfer.transport.options`): an unknown transport, an
unknown option name or a value of the wrong type is a ``ValueError`` naming
the field before any actor is asked anything::

    cfg = TransferConfig.from_files(model, cluster, transport="mooncake",
                                    transport_options={"protocol": "tcp"})
    cfg.transport_spec          # TransportSpec(kind="mooncake", options=MooncakeOptions(...))

``nic_gbps`` is a shortcut for the simnic option ``bandwidth_gbps``.

``integrity`` (``{"mode": "off" | "sample" | "full", "fraction": 0.1}`` or a
mode name), ``retry`` (``{"attempts", "backoff_s", "backoff_factor",
"max_backoff_s"}``) and ``audit_path`` (a file for one JSON line per update)
are checked here too and typed (:class:`~weight_transfer.integrity.IntegrityPolicy`,
:class:`~weight_transfer.retry.RetryPolicy`); docs/configuration.md says what
each does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scheduling.cluster import ClusterConfig, load_cluster_config
from weight_transfer.integrity import IntegrityPolicy, parse_integrity
from weight_transfer.models import ModelConfig, load_model_config
from weight_transfer.retry import RetryPolicy, parse_retry
from weight_transfer.transport.options import TransportOptions, TransportSpec, parse_transport

# Sample, not off: a NIC or driver that corrupts writes shows in the first update at a
# tenth of full's hashing cost, and ten consecutive updates check every range once.
DEFAULT_INTEGRITY = IntegrityPolicy(mode="sample", fraction=0.1)
DEFAULT_RETRY = RetryPolicy()


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
    transport: str = "simnic"  # the data plane of every trainer and engine NIC
    transport_options: Mapping[str, Any] | TransportOptions | None = None  # checked, then typed
    # Checksums of written ranges, compared after every update (weight_transfer.integrity).
    integrity: Mapping[str, Any] | str | IntegrityPolicy = DEFAULT_INTEGRITY
    # Transient WRITE errors (link down) retried under this policy (weight_transfer.retry).
    retry: Mapping[str, Any] | RetryPolicy = DEFAULT_RETRY
    audit_path: str | Path | None = None  # one JSON line per update / re-sync (actors.audit)

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
        spec = parse_transport(self.transport, self.transport_options, where="TransferConfig")
        object.__setattr__(self, "integrity",
                           parse_integrity(self.integrity, where="TransferConfig.integrity"))
        object.__setattr__(self, "retry", parse_retry(self.retry, where="TransferConfig.retry"))
        if self.audit_path is not None and not isinstance(self.audit_path, str | Path):
            raise ValueError(f"TransferConfig.audit_path must be a path or None, not "
                             f"{self.audit_path!r}")
        object.__setattr__(self, "transport_options", spec.options)  # typed from here on
        if self.nic_gbps is not None and self.transport != "simnic":
            raise ValueError(
                f"TransferConfig.nic_gbps caps simulated NICs only; transport is "
                f"{self.transport!r} (every trainer and engine NIC): leave nic_gbps None")
        if self.nic_gbps is not None and spec.options.bandwidth_gbps not in (None, self.nic_gbps):
            raise ValueError(
                f"TransferConfig.nic_gbps={self.nic_gbps} and transport_options.bandwidth_gbps="
                f"{spec.options.bandwidth_gbps} disagree (the cap of every trainer and engine "
                "NIC); set one of them")

    @classmethod
    def from_files(cls, model: str | Path, cluster: str | Path, **kwargs) -> TransferConfig:
        return cls(model=load_model_config(model), cluster=load_cluster_config(cluster), **kwargs)

    @property
    def transport_spec(self) -> TransportSpec:
        """The validated transport of every trainer and engine NIC (``nic_gbps`` applied)."""
        options = self.transport_options
        if self.nic_gbps is not None:
            options = options.model_copy(update={"bandwidth_gbps": self.nic_gbps})
        return TransportSpec(kind=self.transport, options=options)

    @property
    def engine_fp8(self) -> bool:
        return self.cluster.inference.fp8 if self.fp8 is None else self.fp8

    def with_replicas(self, replicas: int) -> TransferConfig:
        """The same config with the cluster's inference side grown to ``replicas``."""
        inference = self.cluster.inference.model_copy(update={"replicas": replicas})
        return replace(self, cluster=self.cluster.model_copy(update={"inference": inference}))
