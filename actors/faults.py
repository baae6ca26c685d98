"""What happened to a peer, from the exception's type: :class:`FaultKind` of an error.

Remote calls fail with Ray's exceptions (the actor died, it is unavailable, a
``ray.get`` timed out) or with the error the method raised, wrapped in a
``RayTaskError`` whose ``cause`` is the original. The kind is read from those
types through one table, first match wins, never from the message::

    try:
        ray.get(ref)
    except ray.exceptions.RayError as err:
        kind = fault_kind_of(err)   # FaultKind.DEAD, UNRESPONSIVE, INTEGRITY or FAILED
"""

from __future__ import annotations

import ray

from weight_transfer.errors import FaultKind, IntegrityError

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
