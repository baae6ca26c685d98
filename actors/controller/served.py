"""Checks of served memory between updates: on demand and in the background.

The check after an update runs before the resume (:mod:`actors.controller.checks`);
a write into a replica's weights after the resume (an outsider that got at its
memory, a faulty device) would go unnoticed. So the controller keeps, per
replica, checksums of every byte it serves (:mod:`weight_transfer.integrity.served`),
recorded at each update before the resume, and compares served memory with
them::

    watch = ServedWatch(state, calls, config, metrics=m, audit=a, replicas=replica_ops)
    rows = watch.reference_rows(replicas)           # update, paused: hashed with the check
    sums = watch.reference(version, good_replicas, reports, hashed)
    watch.commit(version, sums)                     # after the resume: replicas that serve it
    result = watch.check(mode="full", heal=True)    # ctl.check_integrity(...)
    result.bad, result.healed, result.check.message()

Where the checksums come from: integrity mode ``full`` hashes every WRITE at its
sender, so the trainers' checksums of the source bytes are the reference, at no
extra cost; in ``sample`` mode with the background check on
(``integrity_watch_s`` > 0) every engine rank hashes its tensors in 4 MiB chunks
while still paused, in the same request as the sampled check (one full hash of
the replica per update, inside the pause; kept where the check passed);
otherwise no reference is kept and a check names the replica ``unchecked``.

A ``full`` check hashes every range of every serving replica (all ranks at
once); a ``tick`` hashes the next ``integrity_watch_bytes`` of the rotation
(:meth:`~weight_transfer.integrity.served.ServedBook.tick`), so ceil(served bytes /
``integrity_watch_bytes``) ticks cover every byte. A replica whose bytes differ
is reported (the :class:`~actors.controller.checks.Mismatch` rows name replica,
rank, tensor and byte range), counted (``wt_integrity_mismatches``), and, with
``heal``, held (paused, version None: it stops serving at once) and re-synced
from a peer that holds the version and passed the same check; without a peer
it stays held until the next update fills it. A tick that found a bad replica
checks every other serving replica in full before it heals (a re-sync must not
copy from a peer that differs too). Every check appends one audit
line (``kind: check``). :class:`BackgroundCheck` runs ticks on a thread of the
controller every ``integrity_watch_s`` while no update, re-sync or set-up runs
(it takes the controller's lock without waiting, and skips the tick when busy); a
tick waits at most :data:`TICK_TIMEOUT_S` for engine ranks, so a stopped rank
delays an update by that much at most.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.config import TransferConfig
from actors.controller.audit import AuditLog, CheckAudit, NoAudit
from actors.controller.calls import ControlCalls
from actors.controller.checks import Hashed, IntegrityResult, compare_and_hash, compare_rows
from actors.controller.replicas import ReplicaOps, hold
from actors.controller.state import ControllerState
from weight_transfer.engines.rank import EngineRank, ShadowEngineRank, method_name
from weight_transfer.integrity.checksums import COLUMNS, merge_ranges
from weight_transfer.integrity.served import ServedSums, region_maps, remap, tensor_chunks
from weight_transfer.observe.metrics import TransferMetrics

log = logging.getLogger(__name__)

MODES = ("full", "tick")
# How long a tick waits for engine ranks: the controller's lock is held meanwhile, and an
# update waits for it (a full check on demand waits up to update_timeout_s).
TICK_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedCheck:
    """What one check of served memory found (``check``: the ranges compared and the
    mismatches) and did (``healed``: re-synced; ``held``: bad and left paused)."""

    mode: str
    versions: dict[str, int | None]
    check: IntegrityResult
    bad: tuple[str, ...] = ()  # replicas with a range that differs
    healed: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()  # serving without checksums to compare with

    @property
    def ok(self) -> bool:
        """Every serving replica was compared and every range matched."""
        return self.check.ok and not self.unchecked

    def message(self) -> str:
        parts = [f"served-memory check ({self.mode}): {self.check.ranges} ranges, "
                 f"{self.check.bytes} B compared"]
        if not self.check.ok:
            parts.append(self.check.message())
        if self.healed:
            parts.append(f"re-synced {list(self.healed)} from a peer")
        if self.held:
            parts.append(f"{list(self.held)} held paused (weights_version None)")
        if self.unchecked:
            parts.append(f"no checksums for {list(self.unchecked)} (integrity mode sample "
                         "without integrity_watch_s, or not updated since setup)")
        return "; ".join(parts)


class ServedWatch:
    """The served-memory checks over the controller's state; see the module docstring."""

    def __init__(self, state: ControllerState, calls: ControlCalls, config: TransferConfig, *,
                 metrics: TransferMetrics, audit: AuditLog | NoAudit,
                 replicas: ReplicaOps) -> None:
        self.state, self.calls, self.config = state, calls, config
        self.metrics, self.audit, self.replica_ops = metrics, audit, replicas

    # ------------------------------------------------------------------ the reference

    @property
    def keeps_reference(self) -> bool:
        mode = self.config.integrity.mode
        return mode == "full" or (mode == "sample" and self.config.integrity_watch_s > 0)

    def reference_rows(self, names: Sequence[str]) -> dict[tuple[str, int], np.ndarray]:
        """The ranges every engine rank of ``names`` hashes for the reference, in the
        update's one checksum request (:func:`~actors.controller.checks.compare_and_hash`):
        its tensors in chunks where the engines' hashes are the reference, else none."""
        if not self.keeps_reference or self.config.integrity.mode == "full":
            return {}
        st = self.state
        return {(n, m.rank): tensor_chunks(m) for n in names for m in st.engine_metas[n]}

    def reference(self, version: int, names: Sequence[str], reports: Sequence[Any],
                  hashed: Hashed | None = None, *, timeout_s: float = 0.0
                  ) -> dict[str, ServedSums]:
        """Checksums of every byte ``names`` now hold (they are paused, their check
        passed): the trainers' in full mode, else the rows of :meth:`reference_rows` as the
        engine ranks hashed them (``hashed``: their rows with checksums, or None and why;
        None: asked of the ranks now, waiting ``timeout_s``, as ``wt bench served`` does)."""
        st = self.state
        if not names or not self.keeps_reference:
            return {}
        if hashed is None and self.config.integrity.mode != "full":
            hashed = compare_and_hash(
                mode="reference", rows={}, also=self.reference_rows(names),
                replicas=st.replicas, metas=st.engine_metas, call=self.calls.call,
                get=self.calls.ledger.get, timeout_s=timeout_s)[1]
        if self.config.integrity.mode == "full":
            merged = merge_ranges([s for r in reports for s in r.transfer.checksums])
            empty = np.empty((0, len(COLUMNS)), dtype=np.uint64)
            out = {n: ServedSums(version=version, source="trainers", ranks=tuple(
                merged.get((n, m.rank), empty) for m in st.engine_metas[n])) for n in names}
            return self._followers_from_leaders(out)
        rows, failed = {}, set()
        for key in ((n, m.rank) for n in names for m in st.engine_metas[n]):
            rows[key], why = hashed.get(key, (None, "not hashed with the check"))
            if rows[key] is None:
                log.warning("no served-memory checksums for %s/tp%d: %s", *key, why)
                failed.add(key[0])
        return {n: ServedSums(version=version, source="engine", ranks=tuple(
            rows[(n, m.rank)] for m in st.engine_metas[n])) for n in names if n not in failed}

    def _followers_from_leaders(self, sums: dict[str, ServedSums]) -> dict[str, ServedSums]:
        """A replica group's follower holds its leader's bytes (a peer copy, no trainer
        wrote it): the leader's trainer checksums at the follower's addresses."""
        st = self.state
        for follower, leader in self.replica_ops.groups.followers(st.replicas).items():
            if follower in sums and leader in sums:
                maps = region_maps(st.engine_metas[leader], st.engine_metas[follower])
                sums[follower] = ServedSums(version=sums[leader].version, source="trainers",
                                            ranks=tuple(remap(rows, m) for rows, m in zip(
                                                sums[leader].ranks, maps, strict=True)))
        return sums

    def commit(self, version: int, sums: dict[str, ServedSums]) -> None:
        """Keep the reference of the replicas that now serve ``version``; drop the rest."""
        st = self.state
        for name in list(st.replicas):
            if st.versions.get(name) == version and name in sums:
                st.served.record(name, sums[name])
            else:  # torn, or its reference was not taken: an older one would not match
                st.served.drop(name)

    # ------------------------------------------------------------------ checks

    def check(self, *, mode: str = "full", heal: bool = False) -> ServedCheck:
        """Compare served memory with the reference (``mode`` full or tick); see above."""
        if mode not in MODES:
            raise ValueError(f"check_integrity mode must be one of {list(MODES)}, not {mode!r}")
        st, started = self.state, time.time()
        st.check_ready("check_integrity()")
        versions = dict(st.versions)
        serving = [n for n, v in versions.items() if v is not None and n not in st.paused]
        have = [n for n in serving if (s := st.served.get(n)) is not None
                and s.version == versions[n]]
        rows = (st.served.all_rows(have) if mode == "full" else
                st.served.tick(budget_bytes=self.config.integrity_watch_bytes, replicas=have))
        result = self._compare(mode, rows)
        bad = _bad(result)
        if heal and bad and mode == "tick":  # the peers a re-sync copies from: all checked
            peers = self._compare("full", st.served.all_rows([n for n in have if n not in bad]))
            result, bad = _joined(result, peers), sorted({*bad, *_bad(peers)})
        for name in bad:
            count = sum(m.replica == name and m.actual is not None for m in result.mismatches)
            self.metrics.integrity_mismatches(name, count, check=mode)
        for m in result.mismatches:
            (log.error if m.actual is not None else log.warning)(
                "served-memory check (%s): %s", mode, m.describe())
        healed, held = self._heal(bad) if heal and bad else ((), ())
        out = ServedCheck(mode=mode, versions=versions, check=result, bad=tuple(bad),
                          healed=healed, held=held,
                          unchecked=tuple(sorted(set(serving) - set(have))))
        self.audit.record(CheckAudit(mode=mode, started_at=started, finished_at=time.time(),
                                     versions=versions, integrity=result, bad=out.bad,
                                     healed=healed, unchecked=out.unchecked))
        return out

    def _compare(self, mode: str, rows: dict) -> IntegrityResult:
        timeout = (self.config.update_timeout_s if mode == "full"
                   else min(TICK_TIMEOUT_S, self.config.update_timeout_s))
        return compare_rows(mode=f"served-{mode}", rows=rows, replicas=self.state.replicas,
                            metas=self.state.engine_metas, call=self.calls.call,
                            get=self.calls.ledger.get, timeout_s=timeout,
                            checksum=served_checksum(self.config))

    def _heal(self, bad: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Hold every bad replica (it stops serving), then re-sync each from a peer that
        holds the version and is not bad; (re-synced, left held)."""
        st = self.state
        hold(st, self.calls, bad, {})
        for name in bad:
            st.served.drop(name)
        healed, held = [], []
        for name in bad:
            try:
                self.replica_ops.resync(name)
                healed.append(name)
            except (RuntimeError, TimeoutError, ValueError) as exc:
                log.error("served-memory check: could not re-sync %s, it stays paused until "
                          "the next update: %s", name, exc)
                held.append(name)
        return tuple(healed), tuple(held)


def served_checksum(config: TransferConfig) -> str:
    """The rank method that hashes served memory: in shadow mode the registered regions are
    the shadow, and what the engine computes with is its live copy at the same offsets."""
    return method_name(ShadowEngineRank.wt_live_checksum if config.apply == "shadow"
                       else EngineRank.wt_checksum)


def _bad(result: IntegrityResult) -> list[str]:
    """Replicas with a range whose bytes differ (not ranks that did not answer)."""
    return sorted({m.replica for m in result.mismatches if m.actual is not None})


def _joined(a: IntegrityResult, b: IntegrityResult) -> IntegrityResult:
    return IntegrityResult(mode=a.mode, ranges=a.ranges + b.ranges, bytes=a.bytes + b.bytes,
                           seconds=a.seconds + b.seconds,
                           mismatches=a.mismatches + b.mismatches)


class BackgroundCheck:
    """Calls ``tick()`` every ``interval_s`` on a daemon thread while ``lock`` is free
    (never waits for it: a tick while an update runs is skipped); ``stop()`` ends it."""

    def __init__(self, tick: Callable[[], Any], *, interval_s: float,
                 lock: threading.RLock) -> None:
        if interval_s <= 0:
            raise ValueError(f"integrity_watch_s must be positive to run, not {interval_s}")
        self.interval_s, self._tick, self._lock = interval_s, tick, lock
        self._stop = threading.Event()
        self.ticks = self.skipped = 0
        self.busy_s = 0.0  # wall seconds spent in ticks (their cost)
        self._thread = threading.Thread(target=self._loop, name="wt-integrity-watch",
                                        daemon=True)

    def start(self) -> BackgroundCheck:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._lock.acquire(blocking=False):
                self.skipped += 1
                continue
            start = time.perf_counter()
            try:
                if not self._stop.is_set():
                    self._tick()
            except Exception:  # a tick must never end the watch; the next one tries again
                log.exception("background integrity check failed")
            finally:
                self.busy_s += time.perf_counter() - start
                self.ticks += 1
                self._lock.release()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
