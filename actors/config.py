"""What the controller needs to know: the model, the cluster and the transfer settings.

One pydantic model holds every setting the library reads; a run file
(``configs/runs/*.yaml``) embeds the same fields as its ``transfer:`` section,
so YAML and Python set the same names with the same defaults::

    cfg = TransferConfig.from_files("configs/models/tiny_llama.yaml",
                                    "configs/clusters/local_cpu.yaml", fp8=False)
    ctl = WeightTransferController(trainers=..., engines=..., config=cfg)
    cfg.replace(update_timeout_s=30)        # a validated copy
    TransferConfig.from_settings(model, cluster, settings=run.transfer, fp8=run.fp8)

:class:`TransferSettings` is the knobs alone (what a run file's ``transfer:``
sets); :class:`TransferConfig` adds the loaded ``model`` and ``cluster`` and
``fp8`` (``None`` takes the cluster's ``inference.fp8``). With live actors both
may stay None: the model comes from the trainers' live model at ``setup()``
and a simulated cluster from the actors (:mod:`actors.controller.live_config`)::

    ctl = WeightTransferController(trainers=trainers, engines=replicas,
                                   config=TransferConfig())

Both are frozen, picklable and refuse unknown fields
(:class:`~weight_transfer.config_files.StrictModel`); a bad value is a ``ValueError``
naming the field (``TransferConfig.watermark_bytes: ...``, ``TransferConfig.retry.attempts:
...``), and in a run file the file and the field's path (``transfer.watermark_bytes``).
Timeouts bound each phase the controller waits for; a phase that overruns raises naming
the ranks that did not answer.

``transport`` names the data plane every trainer and engine NIC uses
(``simnic``, the default, within one host; ``mooncake``; ``rdma``) and
``transport_options`` its options, checked against that transport's typed
options (:mod:`weight_transfer.transport.options`) and typed from then on::

    cfg = TransferConfig.from_files(model, cluster, transport="mooncake",
                                    transport_options={"protocol": "tcp"})
    cfg.transport_spec          # TransportSpec(kind="mooncake", options=MooncakeOptions(...))

``nic_gbps`` is a shortcut for the simnic option ``bandwidth_gbps``.
``integrity``, ``retry`` and ``audit_path`` are typed here too (and
``integrity_watch_s`` / ``integrity_watch_bytes``, the background check of
served memory, :mod:`actors.controller.served`)
(:class:`~weight_transfer.integrity.checksums.IntegrityPolicy`,
:class:`~weight_transfer.sender.retry.RetryPolicy`); docs/configuration.md says what
each field does.

The ready-made (demo) actors' own settings, the weights seed and learning rate
of ``TrainerActor`` and the logical CPUs of each actor ``launch_*`` starts, are
not the library's: they are a :class:`DemoActorConfig` given to the launch
helpers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt, SerializeAsAny, model_validator

from actors.messages import RankOptions
from scheduling.cluster.config import ClusterConfig, load_cluster_config
from scheduling.flip import shadow_need
from weight_transfer.config_files import FieldError, StrictModel
from weight_transfer.integrity.checksums import IntegrityPolicy
from weight_transfer.model.models import ModelConfig, load_model_config
from weight_transfer.sender.retry import RetryPolicy
from weight_transfer.transport.options import TransportOptions, TransportSpec, parse_transport


class TransferSettings(StrictModel):
    """Every knob the library reads (a run file's ``transfer:`` section); see the module
    docstring."""

    pause_during_update: bool = True
    setup_timeout_s: PositiveFloat = 300.0
    update_timeout_s: PositiveFloat = 120.0
    barrier_timeout_s: PositiveFloat = 60.0
    watermark_bytes: PositiveInt = 1 << 30
    nic_gbps: PositiveFloat | None = None  # cap every simulated NIC (GB/s); None: memcpy speed
    metrics: str = "auto"  # metrics backend: auto (ray inside Ray), ray, prometheus, null
    transport: str = "simnic"  # the data plane of every trainer and engine NIC
    # Checked, then typed (never None); serialized as the backend's own model, not the base.
    transport_options: SerializeAsAny[TransportOptions] | None = None
    # Checksums of written ranges, compared after every update
    # (weight_transfer.integrity.checksums); a mode name or a mapping of the policy's fields.
    integrity: IntegrityPolicy = IntegrityPolicy()
    # Transient WRITE errors (link down) retried under this policy (weight_transfer.sender.retry).
    retry: RetryPolicy = RetryPolicy()
    audit_path: Path | None = None  # one JSON line per update / re-sync (actors.controller.audit)
    # Background check of served memory against the last version's checksums, between
    # updates (actors.controller.served): seconds between ticks (0: off) and bytes hashed per tick.
    integrity_watch_s: NonNegativeFloat = 0.0
    integrity_watch_bytes: PositiveInt = 64 << 20
    # Sparse deltas (actors.controller.delta): write only changed elements, one-sided, into a
    # delta arena per engine rank (this fraction of its bytes), applied in place at finish
    # (shadow mode: to the shadow, brought to the live version first, before the flip);
    # a dense anchor every delta_anchor_every delta updates and after a plan, fault or re-sync.
    delta: bool = False
    delta_anchor_every: PositiveInt = 20
    delta_arena_fraction: PositiveFloat = 0.25
    # "time": each trainer rank writes dense when its measured rates say deltas would
    # take longer (weight_transfer.delta.policy); "off": deltas whenever they are smaller.
    delta_fallback: Literal["time", "off"] = "time"
    # shard_direct: a parameter whose pieces its ranks' own shards cover is written from
    # them with no collective (scheduling.build.direct); full: every parameter gathered first.
    gather: Literal["shard_direct", "full"] = "shard_direct"
    # What a trainer writes from (weight_transfer.sender.zero_copy.sources): zero_copy
    # writes pieces whose bytes already lie in order in its parameters straight from them,
    # the next optimizer step fenced off until the writes complete; snapshot copies every
    # piece first; auto is zero_copy unless the update would overlap a step (then snapshot).
    source: Literal["zero_copy", "snapshot", "auto"] = "auto"
    # How an update lands (weight_transfer.engines.shadow.store): in_place writes the memory the
    # engine computes with while it is paused; shadow writes a second copy while the engine
    # serves, then flips at a step boundary (the pause is the flip; rollback is one flip).
    apply: Literal["in_place", "shadow"] = "in_place"
    # Replicas that share a site (actors.replica_groups): the trainers write one of each
    # group, the others are filled from it by a peer copy inside the group.
    replica_groups: tuple[tuple[str, ...], ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _typed_inputs(cls, data: Any) -> Any:
        """The options typed by the chosen transport, the replica groups parsed (a
        FieldError names ``transport``, ``transport_options.<name>`` or ``replica_groups``)."""
        if not isinstance(data, dict):
            return data
        spec = parse_transport(data.get("transport", "simnic"), data.get("transport_options"))
        data = {**data, "transport_options": spec.options}
        if "replica_groups" in data:
            from actors.replica_groups import ReplicaGroups

            data["replica_groups"] = ReplicaGroups.parse(data["replica_groups"]).groups
        return data

    @model_validator(mode="after")
    def _nic_cap(self) -> TransferSettings:
        if self.delta_arena_fraction > 1:
            raise FieldError(f"delta_arena_fraction must be in (0, 1], not "
                             f"{self.delta_arena_fraction}")
        if self.nic_gbps is not None and self.transport != "simnic":
            raise FieldError(
                f"nic_gbps caps simulated NICs only; transport is "
                f"{self.transport!r} (every trainer and engine NIC): leave nic_gbps None")
        cap = getattr(self.transport_options, "bandwidth_gbps", None)
        if self.nic_gbps is not None and cap not in (None, self.nic_gbps):
            raise FieldError(
                f"nic_gbps={self.nic_gbps} and transport_options.bandwidth_gbps="
                f"{cap} disagree (the cap of every trainer and engine NIC); set one of them")
        return self

    @model_validator(mode="after")
    def _shadow_alone(self) -> TransferSettings:
        if self.apply == "shadow" and self.replica_groups:
            raise FieldError(
                "apply='shadow' does not combine with replica_groups (a "
                "group's followers are filled from their leader's live memory, which a shadow "
                "update writes only at the flip): leave replica_groups empty or use in_place")
        return self

    @property
    def transport_spec(self) -> TransportSpec:
        """The validated transport of every trainer and engine NIC (``nic_gbps`` applied)."""
        options = self.transport_options
        if self.nic_gbps is not None:
            options = options.model_copy(update={"bandwidth_gbps": self.nic_gbps})
        return TransportSpec(kind=self.transport, options=options)

    def rank_options(self) -> RankOptions:
        """What each trainer rank's pipeline needs of these settings (sent with its plan)."""
        return RankOptions(barrier_timeout_s=self.barrier_timeout_s,
                           watermark_bytes=self.watermark_bytes, transport=self.transport_spec,
                           metrics=self.metrics, integrity=self.integrity, retry=self.retry,
                           source=self.source)

    def settings(self) -> TransferSettings:
        """These knobs alone (without a model and a cluster)."""
        return TransferSettings(**{k: getattr(self, k) for k in TransferSettings.model_fields})


class TransferConfig(TransferSettings):
    """The settings with the model and cluster they apply to; see the module docstring.

    ``model`` None: trainer rank 0's live model describes it at ``setup()``; ``cluster``
    None: the controller derives a simulated one from the actors it is given
    (:mod:`actors.controller.live_config`). The launch helpers need both."""

    model: ModelConfig | None = None
    cluster: ClusterConfig | None = None
    fp8: bool | None = None

    @classmethod
    def from_files(cls, model: str | Path, cluster: str | Path, **kwargs: Any) -> TransferConfig:
        return cls(model=load_model_config(model), cluster=load_cluster_config(cluster), **kwargs)

    @classmethod
    def from_settings(cls, model: ModelConfig, cluster: ClusterConfig, *,
                      settings: TransferSettings, **kwargs: Any) -> TransferConfig:
        """``settings`` (e.g. a run file's ``transfer:``) for ``model`` on ``cluster``;
        ``kwargs`` set fields otherwise (``fp8``, a shorter ``update_timeout_s``)."""
        fields = {k: getattr(settings, k) for k in TransferSettings.model_fields}
        return cls(model=model, cluster=cluster, **(fields | kwargs))

    @model_validator(mode="after")
    def _shadow_room(self) -> TransferConfig:
        """Shadow mode needs one more copy of every engine rank's weights: refused where
        the cluster states a GPU memory that cannot hold it (naming the numbers)."""
        if self.apply != "shadow" or self.model is None or self.cluster is None \
                or self.cluster.inference.memory_gib is None:
            return self
        need = shadow_need(self.model, self.cluster, fp8=self.engine_fp8)
        if not need.fits:
            src = f" ({self.cluster.source})" if self.cluster.source else ""
            raise FieldError(f"apply='shadow': {need.message()}{src}; "
                             "use apply='in_place' or more GPUs per replica")
        return self

    @property
    def engine_fp8(self) -> bool:
        if self.fp8 is not None or self.cluster is None:
            return bool(self.fp8)
        return self.cluster.inference.fp8

    def require(self, what: str, fields: tuple[str, ...] = ("model", "cluster")
                ) -> TransferConfig:
        """This config, or ValueError if ``what`` (a launch helper) lacks the ``fields``
        (model, cluster) that describe the actors it starts."""
        missing = [f for f in fields if getattr(self, f) is None]
        if missing:
            raise ValueError(
                f"{what} starts the actors TransferConfig.{' and '.join(missing)} "
                f"describe{'s' if len(missing) == 1 else ''}, and it is None: give it (a "
                "cluster in code: scheduling.cluster.defaults.simulated_cluster(...))")
        return self

    def with_replicas(self, replicas: int) -> TransferConfig:
        """The same config with the cluster's inference side grown to ``replicas``."""
        inference = self.cluster.inference.model_copy(update={"replicas": replicas})
        return self.replace(cluster=self.cluster.model_copy(update={"inference": inference}))


class DemoActorConfig(StrictModel):
    """The ready-made actors' own settings (not the library's): the weights seed and AdamW
    learning rate of ``TrainerActor``, and the logical CPUs of each actor ``launch_trainers``
    and ``launch_engines`` start (Ray only uses them to place actors)."""

    seed: int = 0
    lr: PositiveFloat = 1e-3
    actor_cpus: PositiveFloat = 0.1
