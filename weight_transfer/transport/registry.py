"""The one registry of transport backends: name -> (module, class), imported on first use.

A backend is one module holding one :class:`~weight_transfer.transport.base.TransportBase`
subclass (its ``kind``, its ``Options`` model and its behaviour), registered by name::

    register_transport("memcpy", "my_project.memcpy_nic", "MemcpyNic")
    nic = make_transport("memcpy", owner="trainer0", nic="nic0")   # imports it now

Registering imports nothing (pyverbs and Mooncake are optional); the first
:func:`transport_class` of a name imports its module and checks the class. A
duplicate name is refused, an unknown one is a ValueError listing the
registered names. Configuration-driven callers go through
:meth:`weight_transfer.transport.options.TransportSpec.open`, which validates the
options with the class's ``Options`` first and then calls :func:`make_transport`.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from weight_transfer.transport.base import TransportBase


@dataclass(frozen=True, slots=True)
class _Entry:
    module: str
    cls: str

    def __str__(self) -> str:
        return f"{self.module}:{self.cls}"


_REGISTRY: dict[str, _Entry] = {}
_LOADED: dict[str, type[TransportBase]] = {}
_LOCK = threading.Lock()


def register_transport(name: str, module: str, cls: str) -> None:
    """Register backend ``name`` as class ``cls`` of ``module`` (imported on first use).

    ValueError for an empty or non-string argument or a name already registered.
    """
    for what, value in (("name", name), ("module", module), ("cls", cls)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"register_transport: {what} must be a non-empty string, not "
                             f"{value!r}")
    with _LOCK:
        if name in _REGISTRY:
            raise ValueError(f"register_transport: transport {name!r} is already registered "
                             f"(as {_REGISTRY[name]}); choose another name")
        _REGISTRY[name] = _Entry(module, cls)


def unregister_transport(name: str) -> None:
    """Forget backend ``name`` (tests that register their own); KeyError if unknown."""
    with _LOCK:
        del _REGISTRY[name]
        _LOADED.pop(name, None)


def registered_transports() -> tuple[str, ...]:
    """The registered names, sorted."""
    with _LOCK:
        return tuple(sorted(_REGISTRY))


def check_transport_name(name: Any, *, where: str = "transport") -> str:
    """``name`` if registered; ValueError naming ``where`` and the registered names."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"{where}: unknown transport {name!r}; known: "
                         f"{list(registered_transports())}")
    return name


def transport_class(name: Any) -> type[TransportBase]:
    """The class of backend ``name``, imported on first use and checked."""
    check_transport_name(name)
    with _LOCK:
        cls = _LOADED.get(name)
        entry = _REGISTRY[name]
    if cls is not None:
        return cls
    try:
        found = getattr(importlib.import_module(entry.module), entry.cls)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"transport {name!r}: cannot load {entry}: {exc}") from exc
    if not (isinstance(found, type) and issubclass(found, TransportBase)):
        raise ValueError(f"transport {name!r}: {entry} is not a TransportBase subclass")
    if found.kind != name:
        raise ValueError(f"transport {name!r}: {entry} declares kind {found.kind!r}")
    with _LOCK:
        _LOADED[name] = found
    return found


def make_transport(kind: str, **kwargs: Any) -> Any:
    """Build one NIC of backend ``kind`` (e.g. ``simnic``, ``rdma`` or ``mooncake``)."""
    return transport_class(kind)(**kwargs)


# name -> "module:Class" of every registered backend (read-only view).
BACKENDS: Mapping[str, _Entry] = MappingProxyType(_REGISTRY)

DEFAULT_TRANSPORT_NAME = "simnic"  # the default without RDMA hardware

register_transport("simnic", "weight_transfer.transport.simnic.nic", "SimNic")
register_transport("rdma", "weight_transfer.transport.rdma.transport", "RdmaTransport")
register_transport("mooncake", "weight_transfer.transport.mooncake.transport", "MooncakeTransport")
register_transport("tcp", "weight_transfer.transport.tcp.transport", "TcpTransport")
