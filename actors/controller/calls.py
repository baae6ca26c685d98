"""Calls from the controller to its actors: results in order, errors that name the actor.

One :class:`ControlCalls` per controller wraps its
:class:`~actors.controller.calls.ControlLedger` (which counts the control plane's bytes)
and its progress hook; setup, updates and replica operations wait on actors
through it::

    calls = ControlCalls(ledger, default_timeout_s=cfg.setup_timeout_s)
    calls.progress = hook                      # hook(phase, done, total) while waiting
    metas = calls.gather(refs, ["trainer 0", "trainer 1"], phase="gather metadata")
    calls.each_engine(replicas, EngineRank.wt_pause, 10.0, epoch, names=["engine0"], phase="hold")
    reports, errors = calls.go(trainers, 7, trace=False, until=deadline, budget_s=54.0)

A late actor is a TimeoutError naming the phase and the actors; one that raised
is a RuntimeError naming it and the remote error's first line.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from actors.controller.audit import ProgressHook
from actors.controller.engine_control import cause_of
from actors.reports import RankReport, TrainerFault
from weight_transfer.engines.rank import method_name
from weight_transfer.errors import FaultKind
from weight_transfer.types import EngineRankId


class ControlCalls:
    """Waits on actors for the controller (see the module docstring)."""

    def __init__(self, ledger: ControlLedger, *, default_timeout_s: float) -> None:
        self.ledger = ledger
        self.default_timeout_s = default_timeout_s
        self.progress: ProgressHook | None = None

    def call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        return self.ledger.call(method, *args, **kwargs)

    def gather(self, refs: list, labels: list[str], *, phase: str,
               timeout: float | None = None) -> list:
        """Results in order; errors and timeouts name the phase and the actors."""
        timeout = self.default_timeout_s if timeout is None else timeout
        pending = self.wait(refs, timeout, phase)
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

    def wait(self, refs: list, timeout: float, phase: str) -> list:
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

    def go(self, trainers: Sequence[Any], version: int, *, trace: bool, until: float,
           budget_s: float, overlap: bool | None = None
           ) -> tuple[dict[int, RankReport], dict[int, TrainerFault]]:
        """"Go" to every trainer rank (``wt_update``: only the version crosses Ray, and
        ``trace`` and ``overlap`` when given); wait until ``until`` (``time.monotonic()``,
        ``budget_s`` after the update began) or the first rank that raised (the others may
        wait for it). The ranks' reports, and the faults of those that raised or did not
        finish."""
        args: tuple = (version, trace, overlap) if overlap is not None else (
            (version, True) if trace else (version,))
        refs = {self.ledger.call(t.wt_update, *args): r for r, t in enumerate(trainers)}
        pending, reports, errors = list(refs), {}, {}
        if self.progress is not None:
            self.progress("transfer", 0, len(refs))
        while pending and not errors:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, until - time.monotonic()))
            if not ready:
                break
            for ref in ready:
                try:
                    reports[refs[ref]] = self.ledger.get(ref)
                except ray.exceptions.RayError as err:
                    errors[refs[ref]] = TrainerFault(rank=refs[ref], kind=FaultKind.FAILED,
                                                     error=cause_of(err),
                                                     cause=getattr(err, "cause", None))
            if self.progress is not None:
                self.progress("transfer", len(refs) - len(pending), len(refs))
        for ref in pending:
            errors[refs[ref]] = (
                TrainerFault(rank=refs[ref], kind=FaultKind.ABORTED,
                             error="did not finish: another rank failed") if errors else
                TrainerFault(rank=refs[ref], kind=FaultKind.TIMEOUT,
                             error=f"did not finish within {budget_s:.3g} s (update_timeout_s "
                                   f"less the resume's share)"))
        return reports, errors

    def each_engine(self, replicas: Mapping[str, Sequence[Any]], method: Any, *args: Any,
                    names: Sequence[str], phase: str, timeout: float | None = None) -> list:
        """``method(*args)`` (an ``EngineRank`` member) on every rank of the replicas
        ``names``; results in order."""
        method = method_name(method)  # TypeError for a string: name the member instead
        refs, labels = [], []
        for name in names:
            for rank, actor in enumerate(replicas[name]):
                refs.append(self.ledger.call(getattr(actor, method), *args))
                labels.append(str(EngineRankId(replica=name, rank=rank)))
        return self.gather(refs, labels, phase=phase, timeout=timeout)


def pickled_size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class ControlLedger:
    """See the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.calls = 0

    def _add(self, nbytes: int, calls: int = 0) -> None:
        with self._lock:
            self.bytes += nbytes
            self.calls += calls

    def call(self, method: Any, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """``method.remote(*args, **kwargs)``, counting the arguments' bytes."""
        self._add(pickled_size((args, kwargs)), calls=1)
        return method.remote(*args, **kwargs)

    def record_result(self, value: Any) -> Any:
        self._add(pickled_size(value))
        return value

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        """``ray.get`` counting the results' bytes."""
        return self.record_result(ray.get(refs, timeout=timeout))

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.bytes, self.calls

    def since(self, snap: tuple[int, int]) -> tuple[int, int]:
        nbytes, calls = self.snapshot()
        return nbytes - snap[0], calls - snap[1]
