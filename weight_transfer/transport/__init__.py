"""Data-plane backends behind one :class:`Transport` protocol.

``make_transport(kind, ...)`` builds one NIC of a backend by name, importing
the backend lazily (pyverbs and Mooncake are optional).
"""

from __future__ import annotations

import importlib
from typing import Any

from weight_transfer.transport.base import (
    PeerUnreachableError,
    RemoteAccessError,
    Transport,
    TransportError,
)

BACKENDS: dict[str, str] = {
    "simnic": "weight_transfer.transport.simnic:SimNic",
    "rdma": "weight_transfer.transport.rdma:RdmaTransport",
    "mooncake": "weight_transfer.transport.mooncake:MooncakeTransport",
}


def make_transport(kind: str, **kwargs: Any) -> Transport:
    """Build one NIC of backend ``kind`` (``simnic``, ``rdma`` or ``mooncake``)."""
    try:
        target = BACKENDS[kind]
    except KeyError:
        raise ValueError(f"unknown transport {kind!r}; known: {sorted(BACKENDS)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = [
    "BACKENDS",
    "PeerUnreachableError",
    "RemoteAccessError",
    "Transport",
    "TransportError",
    "make_transport",
]
