"""Where a listener of ours may bind: one address, never a wildcard.

Every port the library opens (the trainers' barrier store, a group's store, the
Prometheus exporter) binds the address that peers reach this node by (the node
address Ray reports) or loopback, never ``0.0.0.0``/``::``: a wildcard listener
answers on every interface, including ones the deployment did not mean to
expose. Mooncake's own listeners are Mooncake's (docs/security.md)::

    host = check_listen_address(node_ip(), what="barrier store")   # ValueError if wildcard
"""

from __future__ import annotations

import ipaddress

WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]", "0", "any"})


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
