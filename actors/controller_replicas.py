"""Replicas of :class:`~actors.controller.WeightTransferController`: add, remove, re-sync.

::

    ctl.add_replica(actors)       # a new replica, filled from a peer, then planned in
    ctl.remove_replica("engine1") # out of the plan and the bookkeeping, its NICs closed
    ctl.resync("engine1")         # a torn replica re-filled from a peer; serves again

A peer copy moves the newest version some replica holds completely from that
replica's engine ranks straight into the other's registered memory
(``wt_copy_to``: rank r to rank r, the same layout), with no trainer traffic.
A re-sync holds the replica first (epoch-fenced pause, version None), copies,
then resumes it with the version under the same deadline
(``config.update_timeout_s``); a replica that cannot be held, filled or
resumed stays torn and paused, and the error names its ranks. Where
``config.integrity`` is on, every region of the filled replica must hash as
its source's (:func:`actors.integrity_check.verify_copy`) before it serves.
Every re-sync appends one line to the audit log (``config.audit_path``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from actors.connections import copy_links
from actors.engine_control import describe_faults, fan_out, next_epoch, wall_deadline
from actors.inference import layout_key
from actors.integrity_check import IntegrityResult, verify_copy
from actors.telemetry import replica_versions
from weight_transfer.engines.rank import EngineRank

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0  # how long remove_replica waits for the removed ranks to close their NICs


def _flat(engine_actors: Sequence[Any]) -> list[Any]:
    out = []
    for e in engine_actors:
        out.extend(e if isinstance(e, list | tuple) else [e])
    return out


class ReplicaOps:
    """Replica membership and peer copies of the controller (mixed into it)."""

    def _source_of(self, version: int, *, besides: str) -> str | None:
        return next((n for n, v in self._versions.items() if v == version and n != besides),
                    None)

    def _copy_replica(self, source: str, target: str, *, version: int, timeout: float
                      ) -> tuple[dict[tuple[str, str], int], IntegrityResult | None]:
        """Peer copy of every rank of ``source`` into ``target`` (connected first): bytes
        per (source rank, target rank), and the check of the filled regions against their
        sources where ``config.integrity`` is on (RuntimeError naming a mismatch)."""
        src, dst = self._engine_metas[source], self._engine_metas[target]
        self._connector.connect(copy_links(src, dst), phase=f"connect {source} to {target}")
        refs = [self.ledger.call(self.replicas[source][r].wt_copy_to, dst[r])
                for r in range(len(dst))]
        labels = [(f"{source}/tp{r}", f"{target}/tp{r}") for r in range(len(refs))]
        done = self._gather(refs, [f"{a} -> {b}" for a, b in labels],
                            phase=f"copy version {version} from {source} to {target}",
                            timeout=timeout)
        check = self._check_copy(source, target, timeout)
        return dict(zip(labels, done, strict=True)), check

    def _check_copy(self, source: str, target: str, timeout: float) -> IntegrityResult | None:
        if not self.config.integrity.enabled:
            return None
        check = verify_copy(source=self.replicas[source], target=self.replicas[target],
                            source_metas=self._engine_metas[source],
                            target_metas=self._engine_metas[target], call=self.ledger.call,
                            get=self.ledger.get, timeout_s=timeout)
        if not check.ok:
            raise RuntimeError(f"copy from {source} to {target}: {check.message()}")
        return check

    def add_replica(self, engine_actors: Sequence[Any]) -> str:
        """Fill a new replica from a peer holding the current version; then plan it in."""
        self._check_ready("add_replica()")
        current = self._newest()
        if current is None:
            raise RuntimeError("add_replica(): no version was transferred yet; run update() first")
        source = self._source_of(current, besides="")
        actors = _flat(engine_actors)
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
            self._each_engine(EngineRank.wt_pause, self.config.setup_timeout_s, next_epoch(),
                              replicas=[name], phase=f"hold {name} until filled")
            self._copy_replica(source, name, version=current,
                               timeout=self.config.setup_timeout_s)
            self._replan()
        except Exception:
            self._forget_replica(name)
            raise
        self._each_engine(EngineRank.wt_resume, current, next_epoch(), replicas=[name],
                          phase=f"resume {name}")
        self._versions[name] = current
        log.info("replica %s filled with version %d from %s", name, current, source)
        return name

    def remove_replica(self, name: str) -> None:
        """Drop replica ``name``: out of the plan (the trainers get a new one), out of
        :meth:`weights_version`, its ranks' NICs closed (best effort: a dead rank has none)."""
        self._check_ready("remove_replica()")
        if name not in self.replicas:
            raise ValueError(f"remove_replica(): no replica {name!r}; replicas: "
                             f"{sorted(self.replicas)}")
        if len(self.replicas) == 1:
            raise ValueError(f"remove_replica(): {name} is the last replica; a plan needs one")
        actors = self.replicas[name]
        self._forget_replica(name)
        self._replan()
        refs = [self.ledger.call(a.wt_close) for a in actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=CLOSE_WAIT_S)
        for rank, ref in enumerate(refs):
            try:
                if ref not in pending:
                    self.ledger.get(ref)
            except ray.exceptions.RayError as exc:
                log.info("removed replica %s: rank %d did not close its NICs: %s", name, rank,
                         type(exc).__name__)
        log.info("replica %s removed; replicas now %s", name, list(self.replicas))

    def _forget_replica(self, name: str) -> None:
        self._drop_replica_entry(name)
        self._versions.pop(name, None)
        self._paused.discard(name)

    def resync(self, name: str) -> int:
        """Re-fill torn replica ``name`` from a peer holding the newest version (no trainer
        traffic) and let it serve again; returns that version (already held: nothing done).

        RuntimeError when no other replica holds a complete version or a rank of
        ``name`` or of the peer fails; TimeoutError past ``config.update_timeout_s``.
        """
        self._check_ready("resync()")
        if name not in self.replicas:
            raise ValueError(f"resync(): no replica {name!r}; replicas: {sorted(self.replicas)}")
        version = self._newest()
        if version is None:
            raise RuntimeError(f"resync({name}): no replica holds a complete version yet")
        if self._versions.get(name) == version and name not in self._paused:
            return version
        source = self._source_of(version, besides=name)
        if source is None:
            raise RuntimeError(f"resync({name}): no other replica holds version {version}")
        started = time.time()
        try:
            return self._resync_from(name, source, version, started)
        except Exception as err:
            self._audit_resync(name=name, source=source, version=version, started=started,
                               pairs={}, check=None, error=err)
            raise

    def _resync_from(self, name: str, source: str, version: int, started: float) -> int:
        deadline = time.monotonic() + self.config.update_timeout_s
        self._versions[name] = None
        self._paused.add(name)
        faults = fan_out(self.ledger, self.replicas, [name], EngineRank.wt_pause,
                         self.config.update_timeout_s, epoch=next_epoch(), until=deadline)
        if faults:
            raise RuntimeError(f"resync({name}): could not hold it: "
                               f"{describe_faults(faults)[name]}")
        try:
            pairs, check = self._copy_replica(source, name, version=version,
                                       timeout=max(0.0, deadline - time.monotonic()))
        except (RuntimeError, TimeoutError):
            self._hold([name], {})
            raise
        faults = fan_out(self.ledger, self.replicas, [name], EngineRank.wt_resume, version,
                         epoch=next_epoch(), deadline=wall_deadline(deadline), until=deadline)
        if faults:
            self._hold([name], faults)
            raise RuntimeError(f"resync({name}): filled with version {version} but not resumed:"
                               f" {describe_faults(faults)[name]}")
        self._versions[name] = version
        self._paused.discard(name)
        replica_versions(self.metrics, {name: version})
        log.info("replica %s re-synced to version %d from %s (%d B)", name, version, source,
                 sum(pairs.values()))
        self._audit_resync(name=name, source=source, version=version, started=started,
                           pairs=pairs, check=check, error=None)
        return version

    def _audit_resync(self, *, name: str, source: str, version: int, started: float,
                      pairs: dict[tuple[str, str], int], check: IntegrityResult | None,
                      error: Exception | None) -> None:
        """One JSON line per re-sync in the audit log, if the configuration names one."""
        if self.audit is None:
            return
        self.audit.record_resync(
            version=version, source=source, target=name, started_at=started,
            finished_at=time.time(), pairs=pairs, outcome="ok" if error is None else "failed",
            integrity=check,
            error=None if error is None else f"{type(error).__name__}: {error}")
