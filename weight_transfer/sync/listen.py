"""Where a listener of ours may bind: one address, never a wildcard; a TCPStore that
honours it.

Every port the library opens (the trainers' barrier store, a group's store, the
Prometheus exporter) binds the address that peers reach this node by (the node
address Ray reports) or loopback, never ``0.0.0.0``/``::``: a wildcard listener
answers on every interface, including ones the deployment did not mean to
expose. Mooncake's own listeners are Mooncake's (docs/security.md)::

    host = check_listen_address(node_ip(), what="barrier store")   # ValueError if wildcard
    store = serve_store("127.0.0.1")                                # a TCPStore server

A ``TCPStore(host, 0, n, True)`` server listens on ``[::]`` whatever ``host``
says (torch binds its own socket to every interface): :func:`serve_store` binds
the socket itself and hands it over (``master_listen_fd``).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from typing import Any

WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]", "0", "any"})


def is_loopback(address: str) -> bool:
    """Whether ``address`` names this host only (``localhost``, 127.0.0.0/8, ::1)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def is_wildcard(address: str) -> bool:
    """Whether binding ``address`` would listen on every interface."""
    text = address.strip().lower()
    if text in WILDCARDS:
        return True
    try:
        return ipaddress.ip_address(text.strip("[]")).is_unspecified
    except ValueError:  # a host name: it resolves to one address
        return False


def check_listen_address(address: object, *, what: str) -> str:
    """``address`` if a listener may bind it; ValueError naming ``what`` otherwise."""
    if not isinstance(address, str) or is_wildcard(address):
        raise ValueError(f"{what}: refusing to listen on {address!r}, a wildcard address "
                         "(every interface); bind the node address peers reach it by, or "
                         "127.0.0.1 for this host only")
    return address


def serve_store(host: str, *, timeout_s: float = 300.0, what: str = "store") -> Any:
    """A TCPStore server listening on a free port of ``host`` only (read it from ``.port``)."""
    import torch.distributed as dist  # torch only where a store is served

    check_listen_address(host, what=what)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot host a {what} on {host!r}: {exc}") from exc
    port = sock.getsockname()[1]
    # The store's server takes the listening socket over (it closes it on shutdown).
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach(),
                         timeout=datetime.timedelta(seconds=timeout_s))
