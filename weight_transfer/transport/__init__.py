"""Data-plane backends behind one :class:`Transport` protocol, chosen by name.

``make_transport(kind, ...)`` (:mod:`.registry`) builds one NIC of a backend by
name, importing the backend lazily (pyverbs and Mooncake are optional). Callers that take the
transport from configuration validate it first and open NICs through the spec::

    spec = parse_transport("simnic", {"bandwidth_gbps": 2.0}, where="TransferConfig")
    nic = spec.open(owner="trainer0", nic="tnode0/nic0")   # make_transport underneath

:mod:`.options` holds each backend's typed options, :mod:`.handshake` the
two-way endpoint exchange of a whole cluster, and :func:`fault_injection` the
optional fault interface that only simnic implements.
"""

from __future__ import annotations

from weight_transfer.transport.base import (
    FaultInjection,
    LinkDownError,
    PeerUnreachableError,
    RemoteAccessError,
    RetriesExhaustedError,
    TransientTransportError,
    Transport,
    TransportError,
    fault_injection,
)
from weight_transfer.transport.options import OPTIONS, TransportSpec, parse_transport
from weight_transfer.transport.registry import BACKENDS, make_transport

assert set(BACKENDS) == set(OPTIONS), "every backend has an options model"


__all__ = [
    "BACKENDS",
    "FaultInjection",
    "LinkDownError",
    "PeerUnreachableError",
    "RemoteAccessError",
    "RetriesExhaustedError",
    "TransientTransportError",
    "Transport",
    "TransportError",
    "TransportSpec",
    "fault_injection",
    "make_transport",
    "parse_transport",
]
