"""Replicas of :class:`~actors.controller.WeightTransferController`: add, remove, re-sync.

::

    ops = ReplicaOps(state, calls, config, metrics=metrics, audit=audit)
    ops.add(actors)               # a new replica, filled from a peer, then planned in
    ops.remove("engine1")         # out of the plan and the bookkeeping, its NICs closed
    ops.resync("engine1")         # a torn replica re-filled from a peer; serves again
    ops.fill_groups(7, faults, reports, errors, until=t)  # replica groups' followers (update)
    hold(state, calls, ["engine1"], faults)   # torn: version None, kept paused

A peer copy moves the newest version some replica holds completely from that
replica's engine ranks straight into the other's registered memory
(``wt_copy_to``: rank r to rank r, the same layout), with no trainer traffic.
A re-sync holds the replica first (epoch-fenced pause, version None), copies,
then resumes it with the version under the same deadline
(``config.update_timeout_s``); a replica that cannot be held, filled or
resumed stays torn and paused, and the error names its ranks. Where
``config.integrity`` is on, every region of the filled replica must hash as
its source's (:func:`actors.controller.checks.verify_copy`) before it serves
(:class:`~weight_transfer.errors.IntegrityError` otherwise). Every re-sync
appends one line to the audit log (``config.audit_path``), where its outcome
is known.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from actors.config import TransferConfig
from actors.connections import copy_links, engine_endpoints
from actors.controller.audit import AuditLog, NoAudit, ResyncAudit, replica_versions
from actors.controller.calls import ControlCalls
from actors.controller.checks import IntegrityResult, verify_copy
from actors.controller.engine_control import (
    RankFault,
    cause_of,
    describe_faults,
    fan_out,
    fault_kind_of,
    next_epoch,
    wall_deadline,
)
from actors.controller.groups import fill_followers, torn_leaders
from actors.controller.setup import group_replicas, replan, setup_shadow, shadow_bytes
from actors.controller.state import ControllerState
from actors.inference import layout_key
from actors.replica_groups import ReplicaGroups
from weight_transfer.engines.rank import EngineRank, ShadowEngineRank, method_name
from weight_transfer.errors import FaultKind, IntegrityError
from weight_transfer.integrity.served import region_maps
from weight_transfer.observe.metrics import TransferMetrics
from weight_transfer.types import EngineRankId

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0  # how long remove waits for the removed ranks to close their NICs
HOLD_WAIT_S = 5.0  # how long holding torn replicas waits for ranks that answer


def flat_actors(engine_actors: Sequence[Any]) -> list[Any]:
    """A list of replicas (lists of actors) or of actors, as one list of actors."""
    out = []
    for e in engine_actors:
        out.extend(e if isinstance(e, list | tuple) else [e])
    return out


def hold(state: ControllerState, calls: ControlCalls, torn: Sequence[str],
         faults: Mapping[str, Sequence[RankFault]]) -> dict[str, list[RankFault]]:
    """Version None and paused for every rank of ``torn``: an epoch-fenced pause, queued
    for ranks that did not answer (not waited for), waited for the others. Returns the
    ranks found dead on the way."""
    if not torn:
        return {}
    epoch, refs, labels, dead = next_epoch(), [], [], {}
    for name in torn:
        state.versions[name] = None
        state.served.drop(name)
        silent = {f.rank for f in faults.get(name, ()) if f.kind.silent}
        for rank, actor in enumerate(state.replicas[name]):
            ref = calls.call(actor.wt_pause, HOLD_WAIT_S, epoch=epoch)
            if rank not in silent:
                refs.append(ref)
                labels.append((name, rank))
    state.paused.update(torn)
    pending = ray.wait(refs, num_returns=len(refs), timeout=HOLD_WAIT_S)[1] if refs else []
    for ref, (name, rank) in zip(refs, labels, strict=True):
        if ref in pending:
            log.error("could not hold %s/tp%d: no answer within %g s", name, rank, HOLD_WAIT_S)
            continue
        try:
            calls.ledger.get(ref)
        except ray.exceptions.RayError as err:
            log.error("could not hold %s/tp%d: %s", name, rank, cause_of(err))
            if fault_kind_of(err) is FaultKind.DEAD:
                dead.setdefault(name, []).append(RankFault(
                    replica=name, rank=rank, kind=FaultKind.DEAD,
                    method=method_name(EngineRank.wt_pause),
                    error=cause_of(err)))
    return dead


class ReplicaOps:
    """Replica membership and peer copies over the controller's state (module docstring)."""

    def __init__(self, state: ControllerState, calls: ControlCalls, config: TransferConfig,
                 *, metrics: TransferMetrics, audit: AuditLog | NoAudit) -> None:
        self.state, self.calls, self.config = state, calls, config
        self.metrics, self.audit = metrics, audit
        self.groups = ReplicaGroups(groups=config.replica_groups)
        self.group_copies: dict[str, int] = {}  # the last update's bytes per filled follower

    def fill_groups(self, version: int, faults: Mapping[str, Any], reports: Mapping[int, Any],
                    errors: Mapping[int, Any], *, until: float) -> dict[str, list[RankFault]]:
        """After the trainers' writes of ``version``: each replica group's followers filled
        from their leader (:mod:`actors.controller.groups`); the faults of those not filled
        (nothing to do without groups)."""
        self.group_copies = {}
        if not self.groups:
            return {}
        torn = torn_leaders(self.state, faults, reports, errors)
        missed, self.group_copies = fill_followers(
            self.state, self.calls, groups=self.groups, version=version, torn=torn,
            until=until, integrity=self.config.integrity.enabled)
        return missed

    def _copy(self, source: str, target: str, *, version: int, timeout: float
              ) -> tuple[dict[tuple[str, str], int], IntegrityResult | None]:
        """Peer copy of every rank of ``source`` into ``target`` (connected first): bytes
        per (source rank, target rank), and the check of the filled regions against their
        sources where ``config.integrity`` is on (IntegrityError naming a mismatch)."""
        st = self.state
        src, dst = st.engine_metas[source], st.engine_metas[target]
        st.connector.connect(copy_links(src, dst), phase=f"connect {source} to {target}")
        refs = [self.calls.call(st.replicas[source][r].wt_copy_to, dst[r])
                for r in range(len(dst))]
        labels = [(str(EngineRankId(replica=source, rank=r)),
                   str(EngineRankId(replica=target, rank=r))) for r in range(len(refs))]
        done = self.calls.gather(refs, [f"{a} -> {b}" for a, b in labels],
                                 phase=f"copy version {version} from {source} to {target}",
                                 timeout=timeout)
        check = self._check_copy(source, target, timeout)
        return dict(zip(labels, done, strict=True)), check

    def _check_copy(self, source: str, target: str, timeout: float) -> IntegrityResult | None:
        if not self.config.integrity.enabled:
            return None
        st = self.state
        check = verify_copy(source=st.replicas[source], target=st.replicas[target],
                            source_metas=st.engine_metas[source],
                            target_metas=st.engine_metas[target], call=self.calls.call,
                            get=self.calls.ledger.get, timeout_s=timeout,
                            source_checksum=self._served_checksum)
        if not check.ok:
            raise IntegrityError(f"copy from {source} to {target}: {check.message()}",
                                 replicas=check.torn)
        return check

    @property
    def shadow(self) -> bool:
        return self.config.apply == "shadow"

    @property
    def _served_checksum(self) -> str:
        """What a peer's served bytes hash with (shadow mode: its live copy)."""
        return method_name(ShadowEngineRank.wt_live_checksum if self.shadow
                           else EngineRank.wt_checksum)

    def _before_fill(self, name: str, version: int, timeout: float) -> None:
        """Hold ``name`` (in place) or stage its shadow with ``version`` (shadow mode: it
        keeps serving what it has until the flip)."""
        method = ShadowEngineRank.wt_stage if self.shadow else EngineRank.wt_pause
        args = (version,) if self.shadow else (timeout,)
        faults = fan_out(self.calls.ledger, self.state.replicas, [name], method, *args,
                         epoch=next_epoch(), until=time.monotonic() + timeout)
        if faults:
            raise RuntimeError(f"could not {'stage' if self.shadow else 'hold'} {name}: "
                               f"{describe_faults(faults)[name]}")

    def _after_fill(self, name: str, version: int, deadline: float) -> dict:
        """Resume ``name`` with ``version`` (in place) or flip to it (shadow mode); faults."""
        method = ShadowEngineRank.wt_flip if self.shadow else EngineRank.wt_resume
        return fan_out(self.calls.ledger, self.state.replicas, [name], method, version,
                       epoch=next_epoch(), deadline=wall_deadline(deadline), until=deadline)

    def add(self, engine_actors: Sequence[Any]) -> str:
        """Fill a new replica from a peer holding the current version; then plan it in."""
        st, calls = self.state, self.calls
        st.check_ready("add_replica()")
        current = st.newest()
        if current is None:
            raise RuntimeError("add_replica(): no version was transferred yet; run update() first")
        source = st.source_of(current, besides="")
        actors = flat_actors(engine_actors)
        if self.shadow:
            st.shadow_bytes.update(shadow_bytes(setup_shadow(
                self.calls, actors, self.config.transport_spec)))
        metas = st.connector.gather_engines(actors, label="new engine actor")
        groups = list(group_replicas(actors, metas))
        if len(groups) != 1:
            raise ValueError(f"add_replica() takes the actors of one replica, got "
                             f"{[g[0] for g in groups]}")
        name, actors, metas = groups[0]
        src = st.engine_metas[source]
        if [layout_key(m) for m in metas] != [layout_key(m) for m in src]:
            raise ValueError(f"replica {name} does not have the TP layout of {source}")
        if name in st.replicas:
            raise ValueError(f"replica {name} is already part of this controller")
        st.connector.check_engines([m.rank for m in st.trainer_metas], metas, sources=src)
        st.add_replica_entry(name, actors, metas)
        timeout = self.config.setup_timeout_s
        try:
            self._before_fill(name, current, timeout)
            self._copy(source, name, version=current, timeout=timeout)
            replan(st, calls, self.config)
        except Exception:
            st.forget_replica(name)
            raise
        faults = self._after_fill(name, current, time.monotonic() + timeout)
        if faults:
            raise RuntimeError(f"add_replica({name}): filled but not serving: "
                               f"{describe_faults(faults)[name]}")
        st.versions[name] = current
        st.previous[name] = None
        self._copy_reference(source, name)
        log.info("replica %s filled with version %d from %s", name, current, source)
        return name

    def remove(self, name: str) -> None:
        """Drop replica ``name``: out of the plan (the trainers get a new one), out of the
        versions, its ranks' NICs closed (best effort: a dead rank has none)."""
        st = self.state
        st.check_ready("remove_replica()")
        if name not in st.replicas:
            raise ValueError(f"remove_replica(): no replica {name!r}; replicas: "
                             f"{sorted(st.replicas)}")
        if len(st.replicas) == 1:
            raise ValueError(f"remove_replica(): {name} is the last replica; a plan needs one")
        actors = st.replicas[name]
        gone = [(ep.owner, ep.nic) for m in st.engine_metas[name] for ep in engine_endpoints(m)]
        st.forget_replica(name)
        replan(st, self.calls, self.config)
        refs = [self.calls.call(a.wt_close) for a in actors]
        # The trainers close their connections to the removed NICs too (else open until then).
        refs += [self.calls.call(t.wt_disconnect, gone) for t in st.trainers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=CLOSE_WAIT_S)
        for rank, ref in enumerate(refs):
            try:
                if ref not in pending:
                    self.calls.ledger.get(ref)
            except ray.exceptions.RayError as exc:
                log.info("removed replica %s: call %d (close its NICs, or a trainer's "
                         "disconnect) failed: %s", name, rank, type(exc).__name__)
        log.info("replica %s removed; replicas now %s", name, list(st.replicas))

    def resync(self, name: str) -> int:
        """Re-fill torn replica ``name`` from a peer holding the newest version (no trainer
        traffic) and let it serve again; returns that version (already held: nothing done).

        RuntimeError when no other replica holds a complete version or a rank of
        ``name`` or of the peer fails; TimeoutError past ``config.update_timeout_s``.
        """
        st = self.state
        st.check_ready("resync()")
        if name not in st.replicas:
            raise ValueError(f"resync(): no replica {name!r}; replicas: {sorted(st.replicas)}")
        version = st.newest()
        if version is None:
            raise RuntimeError(f"resync({name}): no replica holds a complete version yet")
        if st.versions.get(name) == version and name not in st.paused:
            return version
        source = st.source_of(version, besides=name)
        if source is None:
            raise RuntimeError(f"resync({name}): no other replica holds version {version}")
        started = time.time()
        pairs: dict[tuple[str, str], int] = {}
        check: IntegrityResult | None = None
        error: Exception | None = None
        try:
            pairs, check = self._resync_from(name, source, version)
        except Exception as err:
            error = err
        self.audit.record(ResyncAudit(
            version=version, source=source, target=name, started_at=started,
            finished_at=time.time(), pairs=pairs, integrity=check,
            outcome="ok" if error is None else "failed",
            error=None if error is None else f"{type(error).__name__}: {error}"))
        if error is not None:
            raise error
        self._copy_reference(source, name)
        return version

    def _copy_reference(self, source: str, target: str) -> None:
        """``target`` now serves ``source``'s bytes: the same served-memory checksums, at
        its own addresses (:mod:`actors.controller.served`)."""
        st = self.state
        st.served.copy(source, target, addr_maps=region_maps(st.engine_metas[source],
                                                             st.engine_metas[target]))

    def _resync_from(self, name: str, source: str, version: int
                     ) -> tuple[dict[tuple[str, str], int], IntegrityResult | None]:
        st, calls, timeout = self.state, self.calls, self.config.update_timeout_s
        deadline = time.monotonic() + timeout
        if not self.shadow:  # shadow mode: it serves what it has until the flip
            st.versions[name] = None
            st.paused.add(name)
        st.served.drop(name)
        st.previous[name] = None
        try:
            self._before_fill(name, version, timeout)
        except RuntimeError as err:
            raise RuntimeError(f"resync({name}): {err}") from None
        try:
            pairs, check = self._copy(source, name, version=version,
                                      timeout=max(0.0, deadline - time.monotonic()))
        except (RuntimeError, TimeoutError, IntegrityError):
            if self.shadow:
                fan_out(calls.ledger, st.replicas, [name], ShadowEngineRank.wt_discard_shadow,
                        epoch=next_epoch(), until=time.monotonic() + HOLD_WAIT_S)
            else:
                hold(st, calls, [name], {})
            raise
        faults = self._after_fill(name, version, deadline)
        if faults:
            hold(st, calls, [name], faults)
            raise RuntimeError(f"resync({name}): filled with version {version} but not resumed:"
                               f" {describe_faults(faults)[name]}")
        st.versions[name] = version
        st.paused.discard(name)
        replica_versions(self.metrics, {name: version})
        log.info("replica %s re-synced to version %d from %s (%d B)", name, version, source,
                 sum(pairs.values()))
        return pairs, check
