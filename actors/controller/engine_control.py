"""Commands from the controller to engine ranks, replica by replica, under one deadline.

The controller pauses, resumes and marks replicas through :func:`fan_out`: one
call per TP rank of every replica named, all sent at once, waited for until a
deadline (``time.monotonic()``), never longer. Each rank that does not end
well becomes a :class:`RankFault` of its replica, so one dead or stopped rank
costs its own replica and never the others::

    faults = fan_out(ledger, ctl.replicas, ["engine0", "engine1"], EngineRank.wt_pause,
                     until=time.monotonic() + 10, epoch=next_epoch())
    faults    # {"engine1": [RankFault(replica="engine1", rank=1, kind="dead", ...)]}

Fault kinds (:class:`~weight_transfer.errors.FaultKind`, read from the exception's type
by :func:`fault_kind_of`): ``dead`` (the actor died: Ray will not run
it again; the controller drops the replica from the plan), ``unresponsive``
(no answer before the deadline: a stopped or hung process), ``failed`` (the
method raised) and ``refused`` (the rank ignored a stale command and said so).

Epochs fence engine-side state changes (:func:`next_epoch`): every pause,
resume and version command carries a number larger than every earlier one,
and an engine rank ignores a command older than the newest it has seen. A rank
that was stopped while the controller gave up on it and held its replica runs
the queued, older resume later and ignores it; the resume also carries a wall
clock deadline past which the rank refuses it, whatever order the queued
calls run in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from weight_transfer.engines.rank import method_name
from weight_transfer.errors import FaultKind, IntegrityError
from weight_transfer.types import EngineRankId

_last_epoch = 0


def next_epoch() -> int:
    """A number larger than every earlier one in this process and, through the clock, than
    those of an earlier controller process on this host (nanoseconds since the epoch)."""
    global _last_epoch
    _last_epoch = max(_last_epoch + 1, time.time_ns())
    return _last_epoch


def wall_deadline(deadline: float) -> float:
    """The ``time.time()`` matching a ``time.monotonic()`` deadline (for the engine side)."""
    return time.time() + max(0.0, deadline - time.monotonic())


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFault:
    """One engine rank that did not carry out a command."""

    replica: str
    rank: int
    kind: FaultKind  # DEAD, UNRESPONSIVE, FAILED or REFUSED (from fan_out)
    method: str
    error: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FaultKind(self.kind))  # ValueError: not a kind

    @property
    def label(self) -> str:
        return str(EngineRankId(replica=self.replica, rank=self.rank))

    def describe(self) -> str:
        return f"{self.label} {self.kind} at {self.method}: {self.error}"


def cause_of(err: BaseException) -> str:
    """The first line of the error a remote call raised (Ray's wrapper unwrapped)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}"


def fan_out(ledger: Any, replicas: Mapping[str, Sequence[Any]], names: Sequence[str],
            method: Callable[..., Any], *args: Any, until: float,
            **kwargs: Any) -> dict[str, list[RankFault]]:
    """Call ``method`` (an ``EngineRank`` member, e.g. ``EngineRank.wt_pause``) on every rank
    of ``names`` at once; the faults per replica (none: {}).

    Waits until ``until`` (a ``time.monotonic()`` deadline) at most; a rank still running then is
    ``unresponsive`` (its call stays queued in its actor: commands must be
    fenced by epochs, see the module docstring).
    """
    method = method_name(method)
    refs: dict[Any, tuple[str, int]] = {}
    for name in names:
        for rank, actor in enumerate(replicas[name]):
            refs[ledger.call(getattr(actor, method), *args, **kwargs)] = (name, rank)
    if not refs:
        return {}
    wait_s = max(0.0, until - time.monotonic())
    _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
    faults: dict[str, list[RankFault]] = {}
    for ref, (name, rank) in refs.items():
        kind, error = None, ""
        if ref in pending:
            kind, error = FaultKind.UNRESPONSIVE, f"no answer within {wait_s:.3g} s"
        else:
            try:
                result = ledger.get(ref)
            except ray.exceptions.RayError as err:
                kind, error = fault_kind_of(err), cause_of(err)
            else:
                if result is False:
                    kind, error = FaultKind.REFUSED, "the rank ignored the command as stale"
        if kind is not None:
            faults.setdefault(name, []).append(
                RankFault(replica=name, rank=rank, kind=kind, method=method, error=error))
    return faults


def describe_faults(faults: Mapping[str, Sequence[RankFault]]) -> dict[str, str]:
    """``{replica: "engine1/tp1 unresponsive at wt_resume: ...; ..."}``."""
    return {name: "; ".join(f.describe() for f in fs) for name, fs in sorted(faults.items())}


def merge_faults(into: dict[str, list[RankFault]], more: Mapping[str, Sequence[RankFault]]
                 ) -> None:
    """Add the faults of ``more`` to the table ``into``, replica by replica."""
    for name, faults in more.items():
        into.setdefault(name, []).extend(faults)


def dead_replicas(faults: Mapping[str, Sequence[RankFault]]) -> list[str]:
    """Replicas with a rank whose actor died (they never come back: drop them)."""
    return sorted(name for name, fs in faults.items() if any(f.kind is FaultKind.DEAD for f in fs))


def responsive(faults: Mapping[str, Sequence[RankFault]], name: str) -> bool:
    """Every rank of ``name`` answered (it may have failed, but it runs)."""
    return all(not f.kind.silent for f in faults.get(name, ()))


# (exception type, kind), most specific first: ActorUnavailableError is a RayActorError.
_KINDS: tuple[tuple[type[BaseException], FaultKind], ...] = (
    (ray.exceptions.ActorUnavailableError, FaultKind.UNRESPONSIVE),
    (ray.exceptions.RayActorError, FaultKind.DEAD),
    (ray.exceptions.GetTimeoutError, FaultKind.UNRESPONSIVE),
    (IntegrityError, FaultKind.INTEGRITY),
)


def fault_kind_of(err: BaseException) -> FaultKind:
    """The kind of ``err`` (a Ray error, or the cause it wraps); FAILED if no row matches."""
    for candidate in (err, getattr(err, "cause", None)):
        for cls, kind in _KINDS:
            if isinstance(candidate, cls):
                return kind
    return FaultKind.FAILED
