"""The one registry of transport backends: name -> class, imported on first use.

``make_transport("simnic", owner=..., nic=...)`` imports only the backend it
builds (pyverbs and Mooncake are optional). Configuration-driven callers go
through :meth:`weight_transfer.transport.options.TransportSpec.open`, which
validates the options first and then calls this.
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, str] = {
    "simnic": "weight_transfer.transport.simnic:SimNic",
    "rdma": "weight_transfer.transport.rdma:RdmaTransport",
    "mooncake": "weight_transfer.transport.mooncake:MooncakeTransport",
}


def make_transport(kind: str, **kwargs: Any) -> Any:
    """Build one NIC of backend ``kind`` (``simnic``, ``rdma`` or ``mooncake``)."""
    try:
        target = BACKENDS[kind]
    except KeyError:
        raise ValueError(f"unknown transport {kind!r}; known: {sorted(BACKENDS)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
