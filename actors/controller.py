"""WeightTransferController: setup once, then one call per weight update.

::

    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()                      # gather metadata, plan once, connect every NIC
    report = ctl.update(version=1)   # pause, "go", collect reports, resume
    ctl.weights_version()            # {"engine0": 1, "engine1": 1}
    ctl.add_replica(new_actors)      # filled from a peer replica, then in the plan
    ctl.remove_replica("engine1")    # out of the plan, its NICs closed
    ctl.resync("engine1")            # a torn replica re-filled from a peer, serving again
    ctl.setup(trainers=new_trainers) # after a trainer was replaced: plan and connect again
    ctl.update(version=2, trace="v2.json")   # also a Chrome trace of the update (Perfetto)

Every update records metrics (:mod:`weight_transfer.metrics`, backend
``config.metrics``); ``ctl.progress = hook`` is called ``hook(phase, done,
total)`` while the controller waits on actors (see :mod:`actors.telemetry`),
also for the ``transfer`` phase right after every trainer got "go".

``engines`` is a list of replicas (each a list of its TP ranks' actors) or a
flat list of engine actors; each actor says which replica and rank it is.

Setup: the trainers' and engines' metadata and hosts are gathered (the
engines register their weight buffers with NICs of ``config.transport``);
a transport that cannot reach a peer (simnic across hosts) is refused here,
naming the actors and their hosts; the plan is computed; then every
(trainer NIC, engine NIC) pair the plan writes through exchanges endpoint
information in both directions in one round for the whole cluster
(:mod:`actors.connections`): every actor is asked at once for its peer info
made for each peer NIC named, and each side gets the other's with the next
call (the trainers with their plan), then connects. ``setup()`` again (with
``trainers=`` after a trainer was replaced, or after an engine's regions were
revoked and registered again) gathers everything again, keeps the replicas'
versions, drops replicas whose actors died, and plans and connects anew.

An update (:mod:`actors.controller_update`), all under one deadline of
``config.update_timeout_s``: every replica is paused (unless
``pause_during_update`` is off), replica by replica; every trainer gets
``wt_update(version)`` (the only argument that crosses Ray) and replays its
static plan with one-sided writes; a replica is resumed with the new version
only after every trainer reported that all its writes of that version landed
and every rank of the replica paused. A replica that missed bytes, did not
pause or did not resume is torn (``None`` in :meth:`weights_version`) and
held paused (an epoch-fenced pause that also lands in a stopped rank's queue,
:mod:`actors.engine_control`), so it never serves a torn version; the others
resume with the new version. A replica whose actor died is dropped from the
plan; torn replicas whose ranks answer are re-filled from a peer that holds
the version right away (``auto_resync``). The :class:`UpdateError` names the
trainer ranks, the replicas and their ranks. See docs/reliability.md.
Where ``config.integrity`` hashed WRITEs, every engine rank of a replica must
hold ranges that hash as the trainers' source bytes did before the replica
resumes (:mod:`actors.integrity_check`): a mismatch tears it, and the error
names the replica, rank, tensor, range and both checksums. With
``config.audit_path``, every update and re-sync appends one JSON line
(:mod:`actors.audit`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from actors.audit import AuditLog
from actors.config import TransferConfig
from actors.connections import Connector, plan_links
from actors.controller_replicas import ReplicaOps
from actors.controller_update import UpdateError, UpdateSteps
from actors.engine_control import cause_of, dead_replicas, describe_faults, fan_out
from actors.groups import host_store, node_ip
from actors.ledger import ControlLedger
from actors.messages import PlanSummary, TrainerRankMeta, check_trainer_metas
from actors.metrics_ray import actor_metrics
from actors.placement import trainer_rank_infos
from actors.schedule_actor import ScheduleActor
from actors.telemetry import ProgressHook
from weight_transfer.engines.rank import EngineRank, method_name
from weight_transfer.transport.handshake import Connection
from weight_transfer.types import EngineRankMeta, RankInfo

log = logging.getLogger(__name__)

__all__ = ["UpdateError", "WeightTransferController"]


def _flatten(engines: Sequence[Any]) -> list[Any]:
    out = []
    for e in engines:
        out.extend(e if isinstance(e, list | tuple) else [e])
    return out


class WeightTransferController(UpdateSteps, ReplicaOps):
    """See the module docstring."""

    def __init__(self, *, trainers: Sequence[Any], engines: Sequence[Any],
                 config: TransferConfig) -> None:
        if not trainers:
            raise ValueError("WeightTransferController needs at least one trainer actor")
        if not engines:
            raise ValueError("WeightTransferController needs at least one engine actor")
        self.config = config
        self.pause_during_update = config.pause_during_update  # may change between updates
        self.auto_resync = True  # re-fill torn replicas from a peer right after a failure
        self.trainers = list(trainers)
        self._engine_handles = _flatten(engines)
        self.ledger = ControlLedger()
        self.replicas: dict[str, list[Any]] = {}
        self._engine_metas: dict[str, list[EngineRankMeta]] = {}
        self._connector = Connector(config.transport_spec, call=self.ledger.call,
                                    gather=self._gather)  # NIC owners, hosts, links
        self._rank_infos: tuple[RankInfo, ...] = ()
        self._versions: dict[str, int | None] = {}
        self._paused: set[str] = set()
        self._trainer_metas: list[TrainerRankMeta] = []
        self.summary: PlanSummary | None = None
        self.scheduler = None
        self._store = None
        self._store_host = ""
        self._attempted: int | None = None
        self.metrics = actor_metrics(config.metrics)
        self.progress: ProgressHook | None = None  # hook(phase, done, total) while waiting
        self.audit = AuditLog(config.audit_path) if config.audit_path is not None else None
        # Test hook: called with the version after the trainers' writes, before the check.
        self.after_transfer: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ helpers

    def _gather(self, refs: list, labels: list[str], *, phase: str,
                timeout: float | None = None) -> list:
        """Results in order; errors and timeouts name the phase and the actors."""
        timeout = self.config.setup_timeout_s if timeout is None else timeout
        pending = self._wait(refs, timeout, phase)
        if pending:
            late = [label for ref, label in zip(refs, labels, strict=True) if ref in pending]
            raise TimeoutError(f"{phase}: {', '.join(late)} did not answer within {timeout:g} s")
        out = []
        for ref, label in zip(refs, labels, strict=True):
            try:
                out.append(self.ledger.get(ref))
            except ray.exceptions.RayError as err:
                raise RuntimeError(f"{phase}: {label} failed: {cause_of(err)}") from err
        return out

    def _wait(self, refs: list, timeout: float, phase: str) -> list:
        """The refs still pending after ``timeout``; reports progress to ``self.progress``."""
        if self.progress is None:
            return ray.wait(refs, num_returns=len(refs), timeout=timeout)[1]
        deadline, pending = time.monotonic() + timeout, list(refs)
        self.progress(phase, 0, len(refs))
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            self.progress(phase, len(refs) - len(pending), len(refs))
        return pending

    def _each_engine(self, method: Any, *args: Any, replicas: Sequence[str], phase: str,
                     timeout: float | None = None) -> list:
        method = method_name(method)  # an EngineRank member
        refs, labels = [], []
        for name in replicas:
            for rank, actor in enumerate(self.replicas[name]):
                refs.append(self.ledger.call(getattr(actor, method), *args))
                labels.append(f"{name}/tp{rank}")
        return self._gather(refs, labels, phase=phase, timeout=timeout)

    def _check_ready(self, what: str) -> None:
        if self.summary is None:
            raise RuntimeError(f"{what} before setup(): call setup() once first")

    # ------------------------------------------------------------------ setup

    def setup(self, *, trainers: Sequence[Any] | None = None) -> PlanSummary:
        """Gather metadata, compute the plan, send every trainer its part, connect NICs.

        Again after a fault: ``trainers`` replaces the trainer actors (a killed
        rank replaced); every engine's metadata is gathered again (regions
        registered again after a revocation), replicas whose actors died are
        dropped, the versions the replicas hold are kept, and the plan and the
        connections are made anew.
        """
        if trainers is not None:
            if not trainers:
                raise ValueError("setup(trainers=...) needs at least one trainer actor")
            self.trainers = list(trainers)
        again = self.summary is not None
        call = self.ledger.call
        metas = self._gather([call(t.wt_param_metas) for t in self.trainers],
                             [f"trainer {i}" for i in range(len(self.trainers))],
                             phase="gather trainer metadata")
        check_trainer_metas(metas)  # on receipt: ValueError naming the rank and field
        order = sorted(range(len(metas)), key=lambda i: metas[i].rank)
        self.trainers = [self.trainers[i] for i in order]
        self._trainer_metas = [metas[i] for i in order]
        self._connector.drop_trainers()  # new actors (or the same): connect them again
        for meta, actor in zip(self._trainer_metas, self.trainers, strict=True):
            self._connector.add_trainer(meta.rank, actor, meta.host)
        if again:
            self._refresh_engines()
        else:
            self._first_engines()
        self._connector.check_engines([m.rank for m in self._trainer_metas],
                                      [m for ms in self._engine_metas.values() for m in ms])
        self._rank_infos = trainer_rank_infos(self.config.cluster,
                                              [m.node for m in self._trainer_metas])
        # The trainers' barrier store, on the address other nodes reach this one by; a new
        # one for every setup (a failed update may have left a crossing's keys behind).
        self._store_host = node_ip()
        self._store = host_store(host=self._store_host, timeout_s=self.config.setup_timeout_s)
        if self.scheduler is None:
            self.scheduler = ScheduleActor.remote(self.config.model, self.config.cluster,
                                                  fp8=self.config.engine_fp8)
        self._replan()
        return self.summary

    def _first_engines(self) -> None:
        engine_metas = self._connector.gather_engines(self._engine_handles, label="engine actor",
                                                     phase="gather engine metadata")
        for name, actors, ranks in self._group_replicas(self._engine_handles, engine_metas):
            self._add_replica_entry(name, actors, ranks)
        self._versions = {name: None for name in self.replicas}

    def _refresh_engines(self) -> None:
        """Every replica's metadata again; a replica whose actor died is dropped, one that
        does not answer keeps its last metadata (it stays torn until it answers)."""
        until = time.monotonic() + self.config.update_timeout_s
        names = list(self.replicas)
        faults = fan_out(self.ledger, self.replicas, names, EngineRank.wt_engine_meta,
                         self.config.transport_spec, until=until)
        for name in dead_replicas(faults):
            log.error("setup: replica %s dropped: %s", name, describe_faults(faults)[name])
            self._forget_replica(name)
        for name in [n for n in names if n in faults and n in self.replicas]:
            log.warning("setup: replica %s keeps its last metadata: %s", name,
                        describe_faults(faults)[name])
        fresh = [n for n in names if n not in faults]
        refs = [self.ledger.call(a.wt_engine_meta, self.config.transport_spec)
                for n in fresh for a in self.replicas[n]]
        metas = iter(self._gather(refs, [f"{n}/tp{r}" for n in fresh
                                         for r in range(len(self.replicas[n]))],
                                  phase="gather engine metadata again"))
        for name in fresh:
            actors = self.replicas[name]
            ranks = [next(metas) for _ in actors]
            self._drop_replica_entry(name, keep_links=True)
            self._add_replica_entry(name, actors, ranks)

    def _group_replicas(self, actors: list, metas: list[EngineRankMeta]):
        groups: dict[str, dict[int, tuple[Any, EngineRankMeta]]] = {}
        for actor, meta in zip(actors, metas, strict=True):
            slot = groups.setdefault(meta.replica, {})
            if meta.rank in slot:
                raise ValueError(f"two engine actors claim {meta.replica}/tp{meta.rank}")
            slot[meta.rank] = (actor, meta)
        for name, slot in groups.items():
            if sorted(slot) != list(range(len(slot))):
                raise ValueError(f"replica {name} has ranks {sorted(slot)}; expected 0..n-1")
            yield name, [slot[r][0] for r in sorted(slot)], [slot[r][1] for r in sorted(slot)]

    def _add_replica_entry(self, name: str, actors: list, metas: list[EngineRankMeta]) -> None:
        if name in self.replicas:
            raise ValueError(f"replica {name} is already part of this controller")
        self.replicas[name], self._engine_metas[name] = actors, metas
        for actor, meta in zip(actors, metas, strict=True):
            self._connector.add_engine(meta, actor)

    def _drop_replica_entry(self, name: str, *, keep_links: bool = False) -> None:
        for meta in self._engine_metas.pop(name, []):
            self._connector.drop_engine(meta, keep_links=keep_links)
        self.replicas.pop(name, None)

    def _replan(self) -> None:
        """Plan over every replica; connect the NIC pairs it writes through (both ways) while
        each trainer gets its blob."""
        cfg = self.config
        engines = [m for metas in self._engine_metas.values() for m in metas]
        result = self._gather(
            [self.ledger.call(self.scheduler.plan, self._trainer_metas, self._rank_infos,
                              engines)],
            ["schedule actor"], phase="compute the plan")[0]
        store = (self._store_host, self._store.port)

        def trainer_call(rank: int, conns: tuple[Connection, ...]) -> Any:
            return self.ledger.call(
                self.trainers[rank].wt_connect, result.blobs[rank], list(conns), store=store,
                rank_info=self._rank_infos[rank], barrier_timeout_s=cfg.barrier_timeout_s,
                watermark_bytes=cfg.watermark_bytes, transport=cfg.transport_spec,
                metrics=cfg.metrics, integrity=cfg.integrity, retry=cfg.retry)

        links = plan_links(self._rank_infos, result.summary.replicas_by_rank, self._engine_metas)
        self._connector.connect(links, phase="distribute the plan",
                                rank_infos=self._rank_infos, trainer_call=trainer_call)
        self.summary = result.summary
        log.info("plan %d: %d B in %d tasks over %d trainer ranks -> replicas %s",
                 self.summary.plan_id, self.summary.bytes_total, self.summary.num_tasks,
                 len(self.trainers), list(self.replicas))

    # ------------------------------------------------------------------ state

    def weights_version(self) -> dict[str, int | None]:
        """``{replica: version it holds completely, or None (torn or never filled)}``."""
        return dict(self._versions)

    def shutdown(self) -> None:
        """Drop the schedule actor and the barrier store (actors stay the caller's)."""
        if self.scheduler is not None:
            ray.kill(self.scheduler)
            self.scheduler = None
        self._store = None
