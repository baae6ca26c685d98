"""Trainer side: a mixin that gives any trainer actor the weight-transfer methods, and
``TrainerActor``, a ready-made FSDP2 trainer that uses it.

An existing trainer actor (OpenRLHF, veRL style) gains the methods by
inheriting :class:`TrainerMixin` and calling :meth:`TrainerMixin.wt_attach`
once its model is sharded (FSDP2), its DeepSpeed engine is built (ZeRO 0-3:
the ZeRO-3 partitions are written from ``ds_tensor``) or its Megatron-core GPTModel
is built (each TP shard written as it is; the source is recognised, or named with
``source=``, :mod:`weight_transfer.sources.registry`)::

    @ray.remote
    class MyTrainer(TrainerMixin):
        def __init__(self, ...):
            ...                                   # init_process_group, fully_shard(model)
            self.wt_attach(model=model, rank=rank, world=world)   # or a ds_engine, a GPTModel

The controller then calls, in order: ``wt_param_metas()`` (setup, gathered),
``wt_endpoints(requests, rank_info=, transport=)`` (setup: opens this rank's
NIC of the configured transport through the registry and returns its peer info
made for each engine NIC named), ``wt_connect(blob, conns, ...)`` (setup: its
plan, the engines' peer infos made for this NIC, barrier store and this setup's
barrier key), and
``wt_update(version)`` at every update (only the version crosses Ray; the rank
replays its static plan with one-sided writes and returns a constant-size
:class:`~actors.reports.RankReport`). NIC fault injection
for tests (``wt_set_link``, ``wt_flap_link``, ``wt_fail_after_bytes``) lives in
the test-only subclass :class:`actors.tools.testkit.hooks.FaultyTrainerActor`.

``TrainerActor`` builds the transformers model (same seed on every rank),
joins a gloo group, shards with FSDP2 (:mod:`actors.ready.trainer_model`), and adds
``train_step`` (a real AdamW step), ``reference_generate`` and
``reference_logits`` (every rank calls; rank 0 answers). Only those code paths
import transformers (through :mod:`weight_transfer.engines.reference.hf_model`), on
first use: a user's
trainer that inherits the mixin does not pay for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from actors.connections import this_host, trainer_owner
from actors.messages import RankOptions, TrainerRankMeta
from actors.metrics_ray import actor_metrics
from actors.reports import RankReport, rank_report_of
from actors.trainer_delta import TrainerDeltaMixin
from actors.write_guard import WriteGuard
from weight_transfer.model.live_metadata import expert_naming_of
from weight_transfer.model.models import ModelConfig, model_config_from_hf
from weight_transfer.observe.trace import rank_trace_of
from weight_transfer.plan.wire import loads_trainer_plan
from weight_transfer.sender.executor import RankTransfer, check_trainer_plan
from weight_transfer.sender.zero_copy.fence import StepFence
from weight_transfer.sources.registry import TrainerSource, open_source
from weight_transfer.sync.barrier import BarrierKey, StoreBarrier
from weight_transfer.sync.store import StoreClient
from weight_transfer.transport.handshake import (
    Connection,
    HostId,
    InfoRequest,
    answer_requests,
    connect_peers,
)
from weight_transfer.transport.options import DEFAULT_TRANSPORT, TransportSpec
from weight_transfer.types import PeerInfo, RankInfo

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Link:
    """This rank's connection to the engines: NIC, barrier store, its transfer and the
    guard that records the transfer's failed writes."""

    nic: Any  # a Transport (make_transport)
    store: Any
    guard: WriteGuard
    transfer: RankTransfer


def run_kept(coro: Any) -> Any:
    """``asyncio.run(coro)``'s result, kept out of the task. In a main thread, Python
    3.11's ``asyncio.run`` restores the SIGINT handler through an Enum lookup that formats
    the finished task's repr, result included: for a transfer report (spans, checksums)
    that cost 10-100 ms per update on every rank."""
    out: list[Any] = []

    async def main() -> None:
        out.append(await coro)

    asyncio.run(main())
    return out[0]


def hf_class_name(model: torch.nn.Module) -> str:
    """The Hugging Face model class of ``model``, under any wrapper class (FSDP2's)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(model).__name__


class TrainerMixin(TrainerDeltaMixin):
    """Weight-transfer methods for a trainer actor; see the module docstring."""

    _wt_model: torch.nn.Module | None = None
    _wt_source: TrainerSource | None = None
    _wt_link: _Link | None = None
    _wt_rank: int = -1
    _wt_nic: Any = None
    _wt_nic_key: tuple[str, TransportSpec] | None = None
    _wt_fence: StepFence | None = None
    # True in a trainer that steps while updates run (async RL): source="auto" snapshots
    wt_overlap: bool = False

    def wt_attach(self, *, model: Any, rank: int, world: int, source: str | None = None
                  ) -> None:
        """Declare the model this rank trains; call once before setup.

        ``model``: an FSDP2-sharded module, a ``DeepSpeedEngine`` (ZeRO 0-3), a model
        ZeRO-3 partitioned, or a Megatron-core ``GPTModel`` (its wrappers, its virtual
        pipeline chunks); ``source`` names how to read it (``"fsdp2"``, ``"deepspeed"``,
        ``"megatron"``; None: recognised, :mod:`weight_transfer.sources.registry`). A
        model the source cannot describe is refused here (ValueError naming the parameter
        and the rank)."""
        if not 0 <= rank < world:
            raise ValueError(f"trainer rank {rank} outside [0, {world})")
        found = open_source(model, rank=rank, world=world, source=source)
        found.check()
        self._wt_source = found
        self._wt_model, self._wt_rank, self._wt_world = found.module, rank, world
        self._wt_link = None
        self._wt_fence = StepFence(label=f"trainer rank {rank}")

    def wt_step_fence(self, timeout_s: float | None = None) -> Any:
        """``with self.wt_step_fence(): optimizer.step()``: the step waits while an update
        writes straight from this rank's parameters (zero-copy), or copies them (snapshot),
        and no update reads them while it runs (:mod:`weight_transfer.sender.zero_copy.fence`)."""
        return self._wt_require_fence().step(timeout_s)

    def wt_wait_writes(self, timeout_s: float | None = None) -> None:
        """Block until no update reads this rank's parameters (for a step that cannot be
        wrapped in :meth:`wt_step_fence`; call it right before the step)."""
        self._wt_require_fence().wait_writes(timeout_s)

    def _wt_require_fence(self) -> StepFence:
        self._wt_require_model()
        return self._wt_fence

    def _wt_require_source(self) -> TrainerSource:
        self._wt_require_model()
        return self._wt_source

    def _wt_require_model(self) -> torch.nn.Module:
        if self._wt_model is None:
            raise RuntimeError(
                f"{type(self).__name__}: call wt_attach(model=, rank=, world=) before setup"
            )
        return self._wt_model

    def wt_param_metas(self) -> TrainerRankMeta:
        """This rank's live parameters (names, global shapes, dtypes, meshes, placements)."""
        model = self._wt_require_model()
        return TrainerRankMeta(
            rank=self._wt_rank,
            world=self._wt_world,
            node=ray.get_runtime_context().get_node_id(),
            expert_naming=expert_naming_of(model),
            params=tuple(self._wt_source.param_metas()),
            host=self.wt_host(),
        )

    def wt_save_checkpoint(self, path: str) -> bool:
        """The attached model's current weights as a Hugging Face checkpoint in ``path``
        (``config.json`` and ``model.safetensors``): what a vLLM engine starts from. A
        collective: every rank calls (FSDP2 shards are gathered); rank 0 writes and returns
        True. ValueError if the model has no Hugging Face ``.config``."""
        model = self._wt_require_model()
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "save_pretrained"):
            raise ValueError(
                f"trainer rank {self._wt_rank}: the attached {type(model).__name__} has no "
                "Hugging Face .config to save beside its weights")
        full = self._wt_require_source().full_state()
        if self._wt_rank != 0:
            return False
        from safetensors.torch import save_file  # a dependency of transformers, on use

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        if not getattr(config, "architectures", None):
            # What model.save_pretrained records and vLLM picks its model class by; FSDP2
            # wraps the class (FSDPLlamaForCausalLM), so name the Hugging Face class under it.
            config.architectures = [hf_class_name(model)]
        config.save_pretrained(out)
        # safetensors refuses tensors that share memory (tied embeddings): one copy each.
        save_file({k: v.contiguous().clone() for k, v in full.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        return True

    def wt_model_config(self) -> ModelConfig:
        """The ModelConfig of this rank's live model (its Hugging Face ``.config`` and
        parameter dtype): what the controller plans with when ``TransferConfig.model`` is
        None. ValueError if the model has no Hugging Face config."""
        model = self._wt_require_model()
        config = getattr(model, "config", None)  # Megatron's TransformerConfig is no HF one
        if not (hasattr(config, "to_dict") or isinstance(config, dict)):
            raise ValueError(
                f"trainer rank {self._wt_rank}: the attached {type(model).__name__} has no "
                "Hugging Face .config; give TransferConfig(model=...) (a model file)")
        return model_config_from_hf(model, source=f"trainer rank {self._wt_rank}")

    def wt_host(self) -> HostId:
        """The host this rank runs on (hostname and address; a simnic reaches only its own)."""
        return this_host()

    @property
    def _wt_owner(self) -> str:
        return trainer_owner(self._wt_rank)

    def _wt_open_nic(self, rank_info: RankInfo, transport: TransportSpec | None) -> Any:
        """This rank's NIC (``rank_info.nic``) of ``transport``; kept while both stay the same."""
        spec = transport or (self._wt_nic_key[1] if self._wt_nic_key else DEFAULT_TRANSPORT)
        key = (rank_info.nic, spec)
        if self._wt_nic is not None and self._wt_nic_key == key:
            return self._wt_nic
        if self._wt_nic is not None:
            self._wt_nic.close()
            self._wt_nic = self._wt_nic_key = None
        self._wt_nic = spec.open(owner=self._wt_owner, nic=rank_info.nic, node=rank_info.node,
                                 address=self.wt_host().address)
        self._wt_nic_key = key
        log.info("trainer rank %d opened NIC %s (%s)", self._wt_rank, rank_info.nic,
                 spec.describe())
        return self._wt_nic

    def wt_endpoints(self, requests: list[InfoRequest], *, rank_info: RankInfo,
                     transport: TransportSpec | None = None) -> tuple[PeerInfo, ...]:
        """Connection set-up, round 1: open this rank's NIC; its peer info for each peer named."""
        self._wt_require_model()
        if rank_info.rank != self._wt_rank:
            raise ValueError(f"trainer rank {self._wt_rank} was sent the rank info of rank "
                             f"{rank_info.rank}")
        nic = self._wt_open_nic(rank_info, transport)
        return answer_requests({rank_info.nic: nic}, requests, owner=self._wt_owner)

    def wt_connect_peers(self, conns: list[Connection]) -> int:
        """Connect this rank's NIC (opened by :meth:`wt_endpoints`) to peer infos made for it,
        without a plan (:meth:`wt_connect` does this together with the plan)."""
        if self._wt_nic is None:
            raise RuntimeError(f"trainer rank {self._wt_rank}: no NIC before wt_endpoints")
        return connect_peers({self._wt_nic_key[0]: self._wt_nic}, conns, owner=self._wt_owner)

    def wt_connect(
        self,
        plan_blob: bytes,
        peers: list[Connection],
        *,
        store: tuple[str, int],
        barrier_key: BarrierKey,
        rank_info: RankInfo,
        options: RankOptions = RankOptions(),
    ) -> int:
        """Connection set-up, round 2: take this rank's plan, connect its NIC to the engine
        NICs (``peers``: their peer infos made for it) with the config's ``options``
        (timeouts, watermark, transport, metrics, integrity, retry). Returns its number of
        tasks.

        The plan is decoded and checked against this rank's parameters first: a
        corrupt or foreign plan is a ValueError, and the rank keeps its previous plan."""
        source = self._wt_require_source()
        plan = loads_trainer_plan(plan_blob)
        if plan.rank != self._wt_rank or rank_info.rank != self._wt_rank:
            raise ValueError(
                f"trainer rank {self._wt_rank} was sent the plan of rank {plan.rank} "
                f"(rank info of {rank_info.rank})"
            )
        metas = source.param_metas()
        check_trainer_plan(plan, metas)  # before anything of the previous plan is dropped
        if self._wt_link is not None:
            self._wt_link.transfer.close()
            self._wt_link.store.close()
        # Re-plan (add_replica): the same NIC, its connections kept; only new peers come.
        nic = self._wt_open_nic(rank_info, options.transport)
        connect_peers({rank_info.nic: nic}, peers, owner=self._wt_owner)
        guard = WriteGuard(label=f"trainer rank {self._wt_rank}")
        kv = StoreClient(*store, key=barrier_key, timeout_s=options.barrier_timeout_s,
                         who=f"trainer rank {self._wt_rank}")
        barrier = StoreBarrier(kv, rank=self._wt_rank, ranks=range(self._wt_world),
                               key=barrier_key, timeout_s=options.barrier_timeout_s)
        transfer = RankTransfer(plan=plan, params=metas, get_param=self._wt_param,
                                transport=nic, barrier=barrier,
                                watermark_bytes=options.watermark_bytes,
                                on_write_error=guard.record,
                                metrics=actor_metrics(options.metrics),
                                integrity=options.integrity, retry=options.retry,
                                source=options.source, fence=self._wt_fence,
                                fence_timeout_s=options.barrier_timeout_s)
        self._wt_register_sources(transfer, source)
        self._wt_link = _Link(nic=nic, store=kv, guard=guard, transfer=transfer)
        log.info("trainer rank %d connected: %d tasks, NIC %s, %d new engine peers",
                 self._wt_rank, len(plan.tasks), rank_info.nic, len(peers))
        return len(plan.tasks)

    def _wt_register_sources(self, transfer: RankTransfer, source: TrainerSource) -> None:
        """The memory zero-copy pieces read from, registered once, at setup."""
        self._wt_params = source.tensors()
        try:
            transfer.register_sources()
        finally:
            self._wt_params = {}

    def _wt_param(self, name: str) -> Any:
        return self._wt_params[name]

    def wt_update(self, version: int, trace: bool = False, overlap: bool | None = None
                  ) -> RankReport:
        """Replay the plan for ``version``: gather, prepare, write, barrier per mesh group.

        ``trace``: the report keeps this rank's spans (:mod:`weight_transfer.observe.trace`).
        ``overlap``: the trainer steps during this update (None: ``wt_overlap``), so
        ``source="auto"`` takes a snapshot (:mod:`weight_transfer.sender.zero_copy.sources`).
        """
        link = self._wt_link
        if link is None:
            raise RuntimeError(f"trainer rank {self._wt_rank}: wt_update before wt_connect")
        self._wt_params = self._wt_require_source().tensors()
        started, offset = time.time(), time.time() - time.perf_counter()
        link.guard.reset()
        try:
            transfer = run_kept(link.transfer.run(
                version=version, overlap=self.wt_overlap if overlap is None else overlap))
        finally:
            self._wt_params = {}
        spans = rank_trace_of(transfer, nic=link.nic.nic, clock_offset=offset) if trace else None
        report = rank_report_of(transfer, failures=link.guard.failures(), started_at=started,
                                finished_at=time.time(), trace=spans)
        log.info("trainer rank %d wrote version %d: %d of %d B in %.3f s (%d failed writes; "
                 "source %s, %d B zero-copy)", self._wt_rank, version, transfer.bytes_written,
                 transfer.bytes_planned, transfer.seconds, sum(f.count for f in report.failures),
                 transfer.source, transfer.zero_copy_bytes)
        return report

    # ------------------------------------------------------------------ test hooks, stats

    def wt_nic_stats(self) -> dict[str, int]:
        nic = self._wt_nic
        if nic is None:  # no NIC opened yet
            return {"bytes_written": 0, "writes": 0}
        return {"bytes_written": nic.bytes_written, "writes": nic.writes}

    @property
    def wt_nic(self) -> Any:
        """This rank's NIC (a Transport), once :meth:`wt_endpoints` or :meth:`wt_connect`
        opened it; else None."""
        return self._wt_nic

    def wt_transport(self) -> str | None:
        """The transport of this rank's NIC (``simnic``, ``mooncake``, ``rdma``), once open."""
        return None if self._wt_nic is None else self._wt_nic.kind

    def wt_disconnect(self, peers: list[tuple[str, str]]) -> int:
        """Close this rank's connections to the engine NICs ``peers`` ((owner, nic) pairs:
        a removed replica's); returns how many were open."""
        if self._wt_nic is None:
            return 0
        return sum(self._wt_nic.disconnect(owner, nic) for owner, nic in peers)

    def wt_close(self) -> None:
        if self._wt_link is not None:
            self._wt_link.transfer.close()
            self._wt_link.store.close()
            self._wt_link = None
        if self._wt_nic is not None:
            self._wt_nic.close()
            self._wt_nic = self._wt_nic_key = None
