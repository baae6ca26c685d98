"""The library's error tree: one root, typed fields, and every error survives pickling.

Every error class of the library derives from :class:`WeightTransferError`,
so a caller can catch all of them with one ``except``; each keeps the builtin
base that says what went wrong (``ValueError`` for bad input,
``RuntimeError`` for a failed peer or device, ``TimeoutError`` for a barrier)::

    WeightTransferError
    |- UpdateError (RuntimeError)           an update left replicas torn (actors.controller)
    |- IntegrityError (RuntimeError)        engine bytes do not hash as their source's
    |- BarrierTimeoutError (TimeoutError)   ranks missing at a barrier
    |- BarrierRefusedError (RuntimeError)   a forged, pre-set or deleted barrier arrival
    |- TransportError (RuntimeError)        weight_transfer.transport.base: RemoteAccessError,
    |                                       PeerUnreachableError, LinkDownError, ...
    |- PipelineError, RdmaUnavailableError, CudaDmaBufError, NoHardwareError, ...

Errors cross processes (Ray pickles what an actor raised; the vLLM mailbox
pickles a worker's exception): :meth:`WeightTransferError.__reduce__` rebuilds
an instance with its message and its typed fields without calling
``__init__``, so keyword-only fields never break unpickling::

    err = UpdateError("update to version 3 failed ...", version=3, ranks={1: "..."},
                      torn=["engine1"])
    pickle.loads(pickle.dumps(err)).torn     # ["engine1"]

:class:`FaultKind` names what happened to a peer, classified from the
exception's type (:func:`actors.controller.engine_control.fault_kind_of`), never from its text.
This module imports nothing but the standard library: the core raises these.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "BarrierRefusedError",
    "BarrierTimeoutError",
    "FaultKind",
    "IntegrityError",
    "UpdateError",
    "WeightTransferError",
]


class FaultKind(enum.StrEnum):
    """What happened to an engine rank, a trainer rank or a WRITE (its value is the label
    used in messages and metrics)."""

    DEAD = "dead"  # the actor died: Ray will not run it again
    UNRESPONSIVE = "unresponsive"  # no answer before the deadline (stopped or hung)
    FAILED = "failed"  # the call raised
    REFUSED = "refused"  # the rank ignored a stale command and said so
    TIMEOUT = "timeout"  # a trainer rank did not finish within the update's deadline
    ABORTED = "aborted"  # a trainer rank stopped waiting because another rank failed first
    INTEGRITY = "integrity"  # bytes landed that do not hash as their source's

    @property
    def silent(self) -> bool:
        """The rank does not answer (dead or unresponsive): do not wait for it."""
        return self in (FaultKind.DEAD, FaultKind.UNRESPONSIVE)


def _rebuild(cls: type[BaseException], args: tuple, state: dict[str, Any]) -> BaseException:
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class WeightTransferError(Exception):
    """The root of the library's errors; see the module docstring."""

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class IntegrityError(WeightTransferError, RuntimeError):
    """Bytes in an engine do not hash as their source's; ``replicas`` are torn by it."""

    def __init__(self, message: str, *, replicas: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.replicas = tuple(replicas)


class BarrierTimeoutError(WeightTransferError, TimeoutError):
    """Ranks did not arrive at a barrier in time; ``missing`` names them."""

    def __init__(self, message: str, *, barrier: str = "", missing: Sequence[int] = (),
                 timeout_s: float = 0.0) -> None:
        super().__init__(message)
        self.barrier, self.missing, self.timeout_s = barrier, tuple(missing), float(timeout_s)


class BarrierRefusedError(WeightTransferError, RuntimeError):
    """A barrier arrival that no rank of this setup made: ``rank`` and ``tag`` say whose
    and where, ``reason`` what was wrong (``forged``, ``pre-arrived``, ``deleted``)."""

    def __init__(self, message: str, *, barrier: str = "", rank: int = -1, tag: str = "",
                 reason: str = "") -> None:
        super().__init__(message)
        self.barrier, self.rank, self.tag, self.reason = barrier, int(rank), tag, reason


class UpdateError(WeightTransferError, RuntimeError):
    """An update failed; ``torn`` replicas hold no complete version now.

    ``ranks``: trainer rank -> what went wrong; ``rank_kinds``: trainer rank ->
    its :class:`FaultKind`; ``replicas``: replica -> what its ranks did (dead,
    unresponsive, failed); ``replica_kinds``: replica -> the fault kinds of its
    ranks; ``lost``: replicas dropped from the plan (an actor died);
    ``resynced``: torn replicas re-filled from a peer right after the failure
    (they hold ``version`` and serve again); ``kept`` (shadow mode): replica -> the
    complete version it still serves, its live memory untouched by the failed transfer.
    """

    def __init__(self, message: str, *, version: int, ranks: Mapping[int, str],
                 torn: Sequence[str], replicas: Mapping[str, str] | None = None,
                 lost: Sequence[str] = (), resynced: Sequence[str] = (),
                 rank_kinds: Mapping[int, FaultKind] | None = None,
                 replica_kinds: Mapping[str, tuple[FaultKind, ...]] | None = None,
                 kept: Mapping[str, int | None] | None = None) -> None:
        super().__init__(message)
        self.version, self.ranks, self.torn = version, dict(ranks), list(torn)
        self.replicas = dict(replicas or {})
        self.lost, self.resynced = list(lost), list(resynced)
        self.rank_kinds = dict(rank_kinds or {})
        self.replica_kinds = dict(replica_kinds or {})
        self.kept: dict[str, int | None] = dict(kept or {})
