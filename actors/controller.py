"""WeightTransferController: setup once, then one call per weight update.

::

    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()                      # gather metadata, plan once, connect every NIC
    report = ctl.update(version=1)   # pause, "go", collect reports, resume
    ctl.weights_version()            # {"engine0": 1, "engine1": 1}
    ctl.add_replica(new_actors)      # filled from a peer replica, then in the plan
    ctl.update(version=2, trace="v2.json")   # also a Chrome trace of the update (Perfetto)

Every update records metrics (:mod:`weight_transfer.metrics`, backend
``config.metrics``); ``ctl.progress = hook`` is called ``hook(phase, done,
total)`` while the controller waits on actors (see :mod:`actors.telemetry`).

``engines`` is a list of replicas (each a list of its TP ranks' actors) or a
flat list of engine actors; each actor says which replica and rank it is.

Setup: the trainers' and engines' metadata and hosts are gathered (the
engines register their weight buffers with NICs of ``config.transport``);
a transport that cannot reach a peer (simnic across hosts) is refused here,
naming the actors and their hosts; the plan is computed once; then every
(trainer NIC, engine NIC) pair the plan writes through exchanges endpoint
information in both directions in one round for the whole cluster
(:mod:`actors.connections`): every actor is asked at once for its peer info
made for each peer NIC named, and each side gets the other's with the next
call (the trainers with their plan), then connects.

An update: every replica is paused (unless ``pause_during_update`` is off);
every trainer gets ``wt_update(version)`` (the only argument that crosses
Ray) and replays its static plan with one-sided writes; a replica is resumed
with the new version only after every trainer reported that all its writes of
that version landed and, where ``config.integrity`` hashed WRITEs, every engine
rank of the replica holds ranges that hash as the trainers' source bytes did
(:mod:`actors.integrity_check`). Any failure marks the replicas that missed bytes
(or hold other bytes) torn
(``None`` in :meth:`weights_version`); they stay paused, so they never serve a
torn version, until a later update succeeds. The error names the ranks (and,
for a checksum mismatch, the replica, rank, tensor, range and both checksums).
With ``config.audit_path``, every update appends one JSON line (:mod:`actors.audit`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from actors.audit import AuditLog, audited_update
from actors.config import TransferConfig
from actors.connections import Connector, copy_links, plan_links
from actors.groups import host_store, node_ip
from actors.inference import layout_key
from actors.integrity_check import IntegrityResult, verify_update
from actors.ledger import ControlLedger
from actors.messages import PlanSummary, TrainerRankMeta, check_trainer_metas
from actors.metrics_ray import actor_metrics
from actors.placement import trainer_rank_infos
from actors.reports import RankReport, UpdateReport
from actors.schedule_actor import ScheduleActor
from actors.telemetry import (
    ProgressHook,
    UpdateClock,
    record_failure,
    record_success,
    update_trace,
)
from weight_transfer.trace import write_chrome_trace
from weight_transfer.transport.handshake import Connection
from weight_transfer.types import EngineRankMeta, RankInfo

log = logging.getLogger(__name__)


class UpdateError(RuntimeError):
    """An update failed; ``torn`` replicas hold no complete version now."""

    def __init__(self, message: str, *, version: int, ranks: dict[int, str], torn: list[str]):
        super().__init__(message)
        self.version, self.ranks, self.torn = version, ranks, torn


def _cause(err: BaseException) -> str:
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _flatten(engines: Sequence[Any]) -> list[Any]:
    out = []
    for e in engines:
        out.extend(e if isinstance(e, list | tuple) else [e])
    return out


class WeightTransferController:
    """See the module docstring."""

    def __init__(self, *, trainers: Sequence[Any], engines: Sequence[Any],
                 config: TransferConfig) -> None:
        if not trainers:
            raise ValueError("WeightTransferController needs at least one trainer actor")
        if not engines:
            raise ValueError("WeightTransferController needs at least one engine actor")
        self.config = config
        self.pause_during_update = config.pause_during_update  # may change between updates
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
        self._current: int | None = None
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
                raise RuntimeError(f"{phase}: {label} failed: {_cause(err)}") from err
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

    def _each_engine(self, method: str, *args: Any, replicas: Sequence[str], phase: str) -> list:
        refs, labels = [], []
        for name in replicas:
            for rank, actor in enumerate(self.replicas[name]):
                refs.append(self.ledger.call(getattr(actor, method), *args))
                labels.append(f"{name}/tp{rank}")
        return self._gather(refs, labels, phase=phase)

    def _check_ready(self, what: str) -> None:
        if self.summary is None:
            raise RuntimeError(f"{what} before setup(): call setup() once first")

    # ------------------------------------------------------------------ setup

    def setup(self) -> PlanSummary:
        """Gather metadata, compute the plan once, send every trainer its part, connect NICs."""
        if self.summary is not None:
            raise RuntimeError("setup() already ran; the plan is computed once")
        call = self.ledger.call
        metas = self._gather([call(t.wt_param_metas) for t in self.trainers],
                             [f"trainer {i}" for i in range(len(self.trainers))],
                             phase="gather trainer metadata")
        check_trainer_metas(metas)  # on receipt: ValueError naming the rank and field
        order = sorted(range(len(metas)), key=lambda i: metas[i].rank)
        self.trainers = [self.trainers[i] for i in order]
        self._trainer_metas = [metas[i] for i in order]
        for meta, actor in zip(self._trainer_metas, self.trainers, strict=True):
            self._connector.add_trainer(meta.rank, actor, meta.host)
        engine_metas = self._connector.gather_engines(self._engine_handles, label="engine actor",
                                                     phase="gather engine metadata")
        groups = list(self._group_replicas(self._engine_handles, engine_metas))
        self._connector.check_engines([m.rank for m in self._trainer_metas],
                                      [m for _, _, ranks in groups for m in ranks])
        for name, actors, ranks in groups:
            self._add_replica_entry(name, actors, ranks)
        self._rank_infos = trainer_rank_infos(self.config.cluster,
                                              [m.node for m in self._trainer_metas])
        # The trainers' barrier store, on the address other nodes reach this one by.
        self._store_host = node_ip()
        self._store = host_store(host=self._store_host, timeout_s=self.config.setup_timeout_s)
        self.scheduler = ScheduleActor.remote(self.config.model, self.config.cluster,
                                              fp8=self.config.engine_fp8)
        self._replan()
        self._versions = {name: None for name in self.replicas}
        return self.summary

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

    def _drop_replica_entry(self, name: str) -> None:
        for meta in self._engine_metas.pop(name, []):
            self._connector.drop_engine(meta)
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

    # ------------------------------------------------------------------ update

    def _check_version(self, version: int) -> None:
        self._check_ready("update()")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be an int, not {version!r}")
        if self._attempted is not None and version <= self._attempted:
            raise ValueError(f"version {version} must be greater than {self._attempted}, "
                             "the last version attempted")

    @audited_update  # a failure the body does not record still leaves an audit line
    def update(self, version: int, *, trace: bool | str | os.PathLike = False) -> UpdateReport:
        """Move the trainers' current weights into every replica as ``version``.

        ``trace``: True brings every rank's spans back in ``report.trace``; a path
        also writes them there as a Chrome trace (Perfetto-readable JSON).
        """
        self._check_version(version)
        self._attempted = version
        started_wall = time.time()  # audit record
        offset = UpdateClock.wall_offset()
        snap, start = self.ledger.snapshot(), time.perf_counter()
        names = list(self.replicas)
        if self.pause_during_update:
            self._each_engine("wt_pause", replicas=[n for n in names if n not in self._paused],
                              phase=f"pause before version {version}")
            self._paused.update(names)
        paused_at = time.perf_counter()
        reports, errors = self._run_trainers(version, bool(trace))
        transfer_done = time.perf_counter()
        if self.after_transfer is not None:  # test hook: between the writes and the check
            self.after_transfer(version)
        torn = set()
        for rank in errors:
            torn.update(self.summary.replicas_by_rank.get(rank, names))
        for rep in reports.values():
            torn.update(rep.failed_replicas)
        # Integrity (actors.integrity_check): after the writes, before any resume.
        check = verify_update(
            policy=self.config.integrity, reports=list(reports.values()),
            replicas={n: self.replicas[n] for n in names if n not in torn},
            metas=self._engine_metas, call=self.ledger.call, get=self.ledger.get,
            timeout_s=self.config.update_timeout_s)
        torn.update(check.torn)
        good = [n for n in names if n not in torn]
        self._finish(version, good, sorted(torn))
        if errors or torn:
            record_failure(self.metrics, errors, reports, sorted(torn), self._versions)
            err = self._update_error(version, reports, errors, sorted(torn), check)
            self._audit_update(version, started_wall, reports, check, names, err)
            raise err
        self._current = version
        nbytes, calls = self.ledger.since(snap)
        end = time.perf_counter()
        clock = UpdateClock(start=start, paused=paused_at, transferred=transfer_done, end=end,
                            offset=offset)
        report = UpdateReport.combine(
            version=version, seconds=end - start, per_rank=list(reports.values()),
            pause_seconds=paused_at - start, resume_seconds=end - transfer_done,
            control_bytes=nbytes, control_calls=calls, replicas=tuple(names),
            trace=self._trace(version, clock, list(reports.values())) if trace else None,
            integrity=check.as_dict())
        record_success(self.metrics, report, self._versions)
        self._audit_update(version, started_wall, reports, check, names, None)
        if trace and not isinstance(trace, bool):
            write_chrome_trace(trace, [report.trace])
        return report

    def _trace(self, version: int, clock: UpdateClock, reports: list[RankReport]):
        cluster = self.config.cluster
        cap = getattr(self.config.transport_spec.options, "bandwidth_gbps", None)  # simnic only
        send = min(cluster.send_bytes_per_s, cap * 1e9) if cap else cluster.send_bytes_per_s
        return update_trace(version=version, clock=clock, reports=reports, summary=self.summary,
                            send_bytes_per_s=send, recv_bytes_per_s=cluster.recv_bytes_per_s)

    def _run_trainers(self, version: int,
                      trace: bool = False) -> tuple[dict[int, RankReport], dict[int, str]]:
        """Send "go"; stop waiting at the first rank that raised (others may wait for it)."""
        args = (version, True) if trace else (version,)  # only the version, unless traced
        refs = {self.ledger.call(t.wt_update, *args): r for r, t in enumerate(self.trainers)}
        pending, reports, errors = list(refs), {}, {}
        deadline = time.monotonic() + self.config.update_timeout_s
        while pending and not errors:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ref in ready:
                try:
                    reports[refs[ref]] = self.ledger.get(ref)
                except ray.exceptions.RayError as err:
                    errors[refs[ref]] = _cause(err)
        for ref in pending:
            errors[refs[ref]] = ("did not finish: another rank failed" if errors else
                                 f"did not finish within {self.config.update_timeout_s:g} s")
        return reports, errors

    def _finish(self, version: int, good: list[str], torn: list[str]) -> None:
        """Resume replicas that got every byte of ``version``; keep torn ones paused."""
        resume = [n for n in good if n in self._paused]
        if resume:
            self._each_engine("wt_resume", version, replicas=resume,
                              phase=f"resume after version {version}")
            self._paused.difference_update(resume)
        running = [n for n in good if n not in resume]
        if running:
            self._each_engine("wt_set_version", version, replicas=running,
                              phase=f"record version {version}")
        for n in good:
            self._versions[n] = version
        for n in torn:
            self._versions[n] = None
        try:
            pause = [n for n in torn if n not in self._paused]
            if pause:
                self._each_engine("wt_pause", replicas=pause, phase="pause torn replicas")
                self._paused.update(pause)
            if torn:
                self._each_engine("wt_set_version", None, replicas=torn,
                                  phase="mark torn replicas")
        except (RuntimeError, TimeoutError) as err:  # a dead engine: the error names it
            log.error("could not hold torn replicas %s: %s", torn, err)

    def _update_error(self, version: int, reports: dict[int, RankReport],
                      errors: dict[int, str], torn: list[str],
                      check: IntegrityResult | None = None) -> UpdateError:
        problems = dict(errors)
        for rank, rep in sorted(reports.items()):
            for f in rep.failures:
                problems[rank] = (f"{f.count} writes ({f.nbytes} B) into {f.replica} "
                                  f"({f.owner}) failed: {f.error}")
        listed = "; ".join(f"trainer rank {r}: {msg}" for r, msg in sorted(problems.items()))
        parts = [f"on trainer ranks {sorted(problems)}: {listed}"] if problems else []
        if check is not None and not check.ok:
            parts.append(check.message())
        msg = (f"update to version {version} failed {'; '.join(parts)}. "
               f"Replicas {torn} are torn (weights_version None) and stay paused")
        log.error(msg)
        return UpdateError(msg, version=version, ranks=problems, torn=torn)

    def _audit_update(self, version: int, started_at: float, reports: dict[int, RankReport],
                      check: IntegrityResult, names: list[str], err: Exception | None) -> None:
        """One line in the audit log (actors.audit), if the configuration names one."""
        if err is not None:
            err.audited = True  # audited_update records nothing more
        if self.audit is not None:
            self.audit.record_update(
                version=version, started_at=started_at, finished_at=time.time(),
                reports=list(reports.values()), integrity=check, replicas=names,
                outcome="ok" if err is None else "failed",
                torn=[] if err is None else getattr(err, "torn", []),
                error=None if err is None else str(err))

    # ------------------------------------------------------------------ replicas

    def weights_version(self) -> dict[str, int | None]:
        """``{replica: version it holds completely, or None (torn or never filled)}``."""
        return dict(self._versions)

    def add_replica(self, engine_actors: Sequence[Any]) -> str:
        """Fill a new replica from a peer holding the current version; then plan it in."""
        self._check_ready("add_replica()")
        if self._current is None:
            raise RuntimeError("add_replica(): no version was transferred yet; run update() first")
        source = next((n for n, v in self._versions.items() if v == self._current), None)
        if source is None:
            raise RuntimeError(f"add_replica(): no replica holds version {self._current}")
        actors = _flatten(engine_actors)
        metas = self._connector.gather_engines(actors, label="new engine actor")
        groups = list(self._group_replicas(actors, metas))
        if len(groups) != 1:
            raise ValueError(f"add_replica() takes the actors of one replica, got "
                             f"{[g[0] for g in groups]}")
        name, actors, metas = groups[0]
        src = self._engine_metas[source]
        if [layout_key(m) for m in metas] != [layout_key(m) for m in src]:
            raise ValueError(f"replica {name} does not have the TP layout of {source}")
        if name in self.replicas:
            raise ValueError(f"replica {name} is already part of this controller")
        self._connector.check_engines([m.rank for m in self._trainer_metas], metas, sources=src)
        self._add_replica_entry(name, actors, metas)
        try:
            self._each_engine("wt_pause", replicas=[name], phase=f"hold {name} until filled")
            self._connector.connect(copy_links(src, metas), phase=f"connect {source} to {name}")
            refs = [self.ledger.call(self.replicas[source][r].wt_copy_to, metas[r])
                    for r in range(len(metas))]
            self._gather(refs, [f"{source}/tp{r} -> {name}/tp{r}" for r in range(len(refs))],
                         phase=f"copy version {self._current} from {source} to {name}")
            self._replan()
        except Exception:
            self._drop_replica_entry(name)
            raise
        self._each_engine("wt_resume", self._current, replicas=[name], phase=f"resume {name}")
        self._versions[name] = self._current
        log.info("replica %s filled with version %d from %s", name, self._current, source)
        return name

    def shutdown(self) -> None:
        """Drop the schedule actor and the barrier store (actors stay the caller's)."""
        if self.scheduler is not None:
            ray.kill(self.scheduler)
            self.scheduler = None
        self._store = None
