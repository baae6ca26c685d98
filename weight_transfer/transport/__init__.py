"""Data-plane backends behind one :class:`Transport` contract, chosen by name.

A backend is one module with one :class:`TransportBase` subclass (its ``kind``,
its ``Options`` model, its optional capabilities), registered by name with
:func:`register_transport` and imported on first use (pyverbs and Mooncake are
optional). ``make_transport(kind, ...)`` builds one NIC; callers that take the
transport from configuration validate it first and open NICs through the spec::

    spec = parse_transport("simnic", {"bandwidth_gbps": 2.0}, where="TransferConfig")
    nic = spec.open(owner="trainer0", nic="tnode0/nic0")   # make_transport underneath

:mod:`.options` validates a name and its options against the registry,
:mod:`.handshake` runs the two-way endpoint exchange of a whole cluster, and
:func:`fault_injection` gives the optional fault interface that only simnic implements.
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
    TransportBase,
    TransportError,
    TransportOptions,
    fault_injection,
)
from weight_transfer.transport.options import TransportSpec, parse_transport
from weight_transfer.transport.registry import (
    BACKENDS,
    make_transport,
    register_transport,
    registered_transports,
    transport_class,
)

__all__ = [
    "BACKENDS",
    "FaultInjection",
    "LinkDownError",
    "PeerUnreachableError",
    "RemoteAccessError",
    "RetriesExhaustedError",
    "TransientTransportError",
    "Transport",
    "TransportBase",
    "TransportError",
    "TransportOptions",
    "TransportSpec",
    "fault_injection",
    "make_transport",
    "parse_transport",
    "register_transport",
    "registered_transports",
    "transport_class",
]
