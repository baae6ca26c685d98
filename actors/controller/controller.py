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
    ctl.check_integrity(heal=True)   # served memory against the held version's checksums

Every update records metrics (:mod:`weight_transfer.observe.metrics`, backend
``config.metrics``); ``ctl.progress = hook`` is called ``hook(phase, done,
total)`` while the controller waits on actors (see :mod:`actors.controller.audit`),
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

The controller holds its state in one :class:`~actors.controller.state.ControllerState`
(replicas, engine metadata, versions, the paused set, trainer metadata and
rank infos, the plan summary, the connector, the barrier store) and hands it
to its parts, which receive everything they use explicitly: setup
(:mod:`actors.controller.setup`), the update steps
(:class:`~actors.controller.update.UpdateSteps`, handed the strategy of
``config.apply`` for each update, :mod:`actors.controller.strategies`) and the replica operations
(:class:`~actors.controller.replicas.ReplicaOps`); waits on actors go through
one :class:`~actors.controller.calls.ControlCalls`.

An update (:mod:`actors.controller.update`), all under one deadline of
``config.update_timeout_s``: every replica is paused (unless
``pause_during_update`` is off), replica by replica; every trainer gets
``wt_update(version)`` (the only argument that crosses Ray) and replays its
static plan with one-sided writes; a replica is resumed with the new version
only after every trainer reported that all its writes of that version landed
and every rank of the replica paused. A replica that missed bytes, did not
pause or did not resume is torn (``None`` in :meth:`weights_version`) and
held paused (an epoch-fenced pause that also lands in a stopped rank's queue,
:mod:`actors.controller.engine_control`), so it never serves a torn version; the others
resume with the new version. A replica whose actor died is dropped from the
plan; torn replicas whose ranks answer are re-filled from a peer that holds
the version right away (``auto_resync``). The :class:`UpdateError` names the
trainer ranks, the replicas and their ranks, with each one's
:class:`~weight_transfer.errors.FaultKind`. See docs/reliability.md.
Where ``config.integrity`` hashed WRITEs, every engine rank of a replica must
hold ranges that hash as the trainers' source bytes did before the replica
resumes (:mod:`actors.controller.checks`): a mismatch tears it, and the error
names the replica, rank, tensor, range and both checksums. Between updates,
:meth:`check_integrity` (and, with ``config.integrity_watch_s``, a background
thread) compares served memory with the checksums of the version each replica
holds and heals a replica that differs by a re-sync (:mod:`actors.controller.served`);
updates, re-syncs, set-ups and checks take one lock, so a check never runs
while an update does. With
``config.audit_path``, every update, re-sync and check appends one JSON line
(:mod:`actors.controller.audit`), recorded by one call where its outcome is known.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from actors.config import TransferConfig
from actors.connections import Connector
from actors.controller.audit import NoAudit, ProgressHook, open_audit, refused_counts
from actors.controller.calls import ControlCalls, ControlLedger
from actors.controller.live_config import with_cluster
from actors.controller.replicas import ReplicaOps, flat_actors
from actors.controller.served import BackgroundCheck, ServedCheck, ServedWatch
from actors.controller.setup import run_setup
from actors.controller.state import ControllerState
from actors.controller.strategies import rollback, strategy_for
from actors.controller.update import UpdateOutcome, UpdateSteps, check_version
from actors.messages import PlanSummary
from actors.metrics_ray import actor_metrics
from actors.ready.handles import check_engines
from actors.reports import UpdateReport
from weight_transfer.engines.rank import EngineRank
from weight_transfer.errors import UpdateError
from weight_transfer.types import EngineRankId

log = logging.getLogger(__name__)

__all__ = ["UpdateError", "WeightTransferController"]


class WeightTransferController:
    """See the module docstring."""

    def __init__(self, *, trainers: Sequence[Any], engines: Sequence[Any],
                 config: TransferConfig) -> None:
        if not trainers:
            raise ValueError("WeightTransferController needs at least one trainer actor")
        if not engines:
            raise ValueError("WeightTransferController needs at least one engine actor")
        check_engines(engines)  # not the 0.1.0 unpacking of launch_vllm_engines
        config = with_cluster(config, trainers, engines)  # derived, or checked: both sides
        self.config = config
        self.pause_during_update = config.pause_during_update  # may change between updates
        self.auto_resync = True  # re-fill torn replicas from a peer right after a failure
        # Test hook: called with the version after the trainers' writes, before the check.
        self.after_transfer: Callable[[int], None] | None = None
        self.ledger = ControlLedger()
        self.calls = ControlCalls(self.ledger, default_timeout_s=config.setup_timeout_s)
        self.metrics = actor_metrics(config.metrics)
        self.audit = open_audit(config.audit_path)
        self.state = ControllerState(
            trainers=list(trainers),
            connector=Connector(config.transport_spec, call=self.ledger.call,
                                gather=self.calls.gather, apply=config.apply))
        self._engine_handles = flat_actors(engines)
        self._replicas = ReplicaOps(self.state, self.calls, config, metrics=self.metrics,
                                    audit=self.audit)
        self._served = ServedWatch(self.state, self.calls, config, metrics=self.metrics,
                                   audit=self.audit, replicas=self._replicas)
        self._updates = UpdateSteps(self.state, self.calls, config, metrics=self.metrics,
                                    replicas=self._replicas, served=self._served)
        # One operation at a time: an update, a re-sync, a set-up or a served-memory check.
        self._busy = threading.RLock()
        self.watch: BackgroundCheck | None = None  # the background check, after setup()

    # ------------------------------------------------------------------ views

    @property
    def progress(self) -> ProgressHook | None:
        """``hook(phase, done, total)``, called while the controller waits on actors."""
        return self.calls.progress

    @progress.setter
    def progress(self, hook: ProgressHook | None) -> None:
        self.calls.progress = hook

    @property
    def trainers(self) -> list[Any]:
        return self.state.trainers

    @property
    def replicas(self) -> dict[str, list[Any]]:
        return self.state.replicas

    @property
    def summary(self) -> PlanSummary | None:
        return self.state.summary

    @property
    def scheduler(self) -> Any:
        return self.state.scheduler

    @property
    def delta(self) -> Any:
        """The :class:`~actors.controller.delta.DeltaChain` (``config.delta``), else None."""
        return self._updates.delta

    @property
    def group_copies(self) -> dict[str, int]:
        """Bytes each follower of a replica group got from its leader in the last update
        (``config.replica_groups``, :mod:`actors.replica_groups`)."""
        return dict(self._replicas.group_copies)

    def weights_version(self) -> dict[str, int | None]:
        """``{replica: version it holds completely, or None (torn or never filled)}``."""
        return dict(self.state.versions)

    # ------------------------------------------------------------------ operations

    def setup(self, *, trainers: Sequence[Any] | None = None) -> PlanSummary:
        """Gather metadata, compute the plan, send every trainer its part, connect NICs.

        Again after a fault: ``trainers`` replaces the trainer actors (a killed
        rank replaced); every engine's metadata is gathered again (regions
        registered again after a revocation), replicas whose actors died are
        dropped, the versions the replicas hold are kept, and the plan and the
        connections are made anew.
        """
        if trainers is not None and not trainers:
            raise ValueError("setup(trainers=...) needs at least one trainer actor")
        with self._busy:
            if trainers is not None:
                self.state.trainers = list(trainers)
            before = {n: list(m) for n, m in self.state.engine_metas.items()}
            summary = run_setup(self.state, self.calls, self.config,
                                engine_handles=self._engine_handles)
            for name in self.state.served.replicas():  # regions registered again: other bytes
                if self.state.engine_metas.get(name) != before.get(name):
                    self.state.served.drop(name)
        if self.config.integrity_watch_s > 0 and self.watch is None:
            self.watch = BackgroundCheck(self._watch_tick, interval_s=self.config.integrity_watch_s,
                                         lock=self._busy).start()
        return summary

    def update(self, version: int, *, trace: bool | str | os.PathLike = False,
               overlap: bool | None = None) -> UpdateReport:
        """Move the trainers' current weights into every replica as ``version``.

        ``trace``: True brings every rank's spans back in ``report.trace``; a path
        also writes them there as a Chrome trace (Perfetto-readable JSON).
        ``overlap``: the trainers step while this update runs (an asynchronous loop), so
        ``source: auto`` writes from snapshots (``report.sources``); None leaves it to
        each trainer's ``wt_overlap`` and to whether a step is in flight.
        Raises :class:`UpdateError` (see the module docstring) when a replica did
        not get the version; every attempted update leaves one audit line.
        """
        with self._busy:
            check_version(self.state, version)  # a refused version number is not an update
            self.state.attempted = self.state.in_flight = version
            started = time.time()
            try:
                strategy = strategy_for(self.state, self.calls, self.config,
                                        pause=self.pause_during_update)
                outcome = self._updates.run(version, strategy, trace=trace, overlap=overlap,
                                            auto_resync=self.auto_resync,
                                            after_transfer=self.after_transfer)
            except Exception as err:  # ended before it had reports: still one audit line
                outcome = UpdateOutcome(version=version, replicas=tuple(self.state.replicas),
                                        error=err, crashed=True)
            finally:
                self.state.in_flight = None
            for refused in outcome.refusals:  # barrier arrivals refused: a line each
                self.audit.record(refused)
            entry = outcome.audit(started_at=started, finished_at=time.time())
            self.audit.record(dataclasses.replace(entry, refused=self._refused()))
        if outcome.error is not None:
            raise outcome.error
        return outcome.report

    def _refused(self) -> dict[str, dict[str, int]]:
        """What the engines' NICs refused since setup, for the audit line (asked only when
        a log is written; an engine that does not answer is left out, with a warning)."""
        if isinstance(self.audit, NoAudit) or not self.state.replicas:
            return {}
        names = list(self.state.replicas)
        ranks = [str(EngineRankId(replica=n, rank=r)) for n in names
                 for r in range(len(self.state.replicas[n]))]
        try:
            stats = self.calls.each_engine(self.state.replicas, EngineRank.wt_nic_stats,
                                           names=names, phase="audit: refused counts",
                                           timeout=10.0)
        except (RuntimeError, TimeoutError) as err:
            log.warning("audit: refused counts not recorded: %s", err)
            return {}
        return refused_counts(ranks, stats)

    def rollback(self) -> dict[str, int | None]:
        """Shadow mode: flip every replica back to the version it held before its last flip
        (one flip each, also after the new version served); returns
        :meth:`weights_version`. ValueError, nothing changed: in place, with an update in
        flight, or a replica without a previous version. One audit line."""
        if not self._busy.acquire(blocking=False):  # an update (or a check) runs now
            raise ValueError(f"rollback(): the update to version {self.state.in_flight} is in "
                             "flight (or a set-up, re-sync or check runs); nothing changed")
        try:
            return rollback(self.state, self.calls, self.config, self.audit,
                            self.state.in_flight)
        finally:
            if self._updates.delta is not None:  # live is older than the trainers' base
                self._updates.delta.request_anchor()
            self._busy.release()

    def add_replica(self, engine_actors: Sequence[Any]) -> str:
        """Fill a new replica from a peer holding the current version; then plan it in."""
        with self._busy:
            return self._replicas.add(engine_actors)

    def remove_replica(self, name: str) -> None:
        """Drop replica ``name``: out of the plan (the trainers get a new one), out of
        :meth:`weights_version`, its ranks' NICs closed (best effort: a dead rank has none)."""
        with self._busy:
            self._replicas.remove(name)

    def resync(self, name: str) -> int:
        """Re-fill torn replica ``name`` from a peer holding the newest version and let it
        serve again; returns that version (see :meth:`ReplicaOps.resync`)."""
        with self._busy:
            if self._updates.delta is not None:
                self._updates.delta.request_anchor()  # a re-filled replica: dense next
            return self._replicas.resync(name)

    def check_integrity(self, mode: str = "full", *, heal: bool = False) -> ServedCheck:
        """Compare what every serving replica holds with the checksums of the version it
        last received (``mode`` ``full``: every byte; ``tick``: the background check's next
        ``integrity_watch_bytes``). The result names each replica, rank, tensor and byte
        range that differs; ``heal`` holds each bad replica and re-syncs it from a peer.
        One audit line per check. Waits for an update in flight to end first."""
        with self._busy:
            result = self._served.check(mode=mode, heal=heal)
        if not result.check.ok:
            log.error("%s", result.message())
        return result

    def _watch_tick(self) -> None:
        """One background tick (the lock is held): check the next slice, heal what differs."""
        if self.state.summary is not None:
            self._served.check(mode="tick", heal=True)

    def shutdown(self) -> None:
        """Stop the background check; drop the schedule actor and the barrier store (actors
        stay the caller's)."""
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        if self.state.scheduler is not None:
            ray.kill(self.state.scheduler)
            self.state.scheduler = None
        if self.state.store is not None:
            self.state.store.close()  # its process
            self.state.store = None
