"""The transport contract every data-plane backend implements, and its shared plumbing.

One object is one NIC of one process. The life of a transfer:

1. the target registers memory (``register``) and publishes the returned
   :class:`RegionDesc` through the control plane (plain data);
2. both sides exchange :class:`PeerInfo` once, each made for the other NIC
   (``peer_info(remote_owner, remote_nic)`` / ``connect``; see
   :mod:`.handshake` for a whole cluster at once);
3. the writer issues one-sided ``write`` calls; the target runs no code;
   completion and errors come back to the writer only;
4. ``disconnect(owner, nic)`` drops the connections to a peer that went away (a
   removed replica); ``deregister`` revokes remote access; ``close`` releases the NIC.

Built-in backends (:mod:`.registry`): ``simnic`` (simulated NIC, the default
without RDMA hardware), ``rdma`` (pyverbs RC queue pairs), ``mooncake``
(Mooncake TransferEngine). A backend is one module with one class deriving
from :class:`TransportBase`, registered with ``register_transport``.

:class:`TransportBase` declares the optional capabilities with their defaults,
so callers never probe with ``getattr``:

- ``Options``: the backend's pydantic options model (a :class:`TransportOptions`);
  ``open_kwargs``, ``reaches`` and ``unreachable_reason`` (classmethods) say how
  a configured spec opens a NIC and which hosts it reaches;
- ``supports_device_memory`` (False): the NIC reads GPU memory (sources stay on it);
- ``registers_sources`` (False) with ``register_source`` / ``deregister_source``:
  the NIC sends only from memory registered with it (long-lived staging buffers);
- ``check_peer(info)``: checks a peer's endpoint fields before any connects;
- ``bytes_written`` / ``writes``: what the NIC delivered;
  ``refused_connections`` / ``refused_writes``: what its target side refused;
- ``grant(owner, nic, regions)``: the regions the plan lets a writer NIC write
  (called before ``peer_info`` for it); ``open_window`` / ``close_window``: the
  engine paused for an update / resumes (tcp enforces both; others ignore them);
- ``disconnect(owner, nic=None)``: closes the connections to a peer;
- ``is_transient(exc)``: whether a failed WRITE may succeed when tried again
  (:mod:`weight_transfer.sender.retry` asks it); by default an instance of
  :class:`TransientTransportError`, which each backend raises for its own
  transient faults.

It also holds the plumbing every backend shares: the peer table behind
``connect`` / ``disconnect`` and the lookup of a write's peer
(:meth:`TransportBase._peer_for`), the destination checks
(:meth:`TransportBase._check_destination`) and one ``max_inflight`` semaphore
per event loop (:meth:`TransportBase._semaphore`).

Errors: :class:`RemoteAccessError` (wrong rkey, out of bounds, revoked) and
:class:`PeerUnreachableError` (peer dead, not connected, disconnected) are
permanent; :class:`TransientTransportError` (simnic: :class:`LinkDownError`) may
clear and is retried by the executor under its ``RetryPolicy``; when it does not
clear, :class:`RetriesExhaustedError` names the NIC, the peer and the region.

Fault injection (link down, fail after N bytes) is an optional interface,
:class:`FaultInjection`, that only simnic implements; callers get it through
:func:`fault_injection`, which names the transport that lacks it.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import ConfigDict

from weight_transfer.config_files import StrictModel
from weight_transfer.errors import WeightTransferError
from weight_transfer.transport.buffers import SourceBuffer, source_buffer, target_buffer
from weight_transfer.types import PeerInfo, RegionDesc

__all__ = [  # the buffer helpers are re-exported: every backend takes them from here
    "FaultInjection", "LinkDownError", "PeerUnreachableError", "RemoteAccessError",
    "RetriesExhaustedError", "SourceBuffer", "TransientTransportError", "Transport",
    "TransportBase", "TransportError", "TransportOptions", "check_write_range",
    "fault_injection", "source_buffer", "target_buffer",
]


class TransportError(WeightTransferError, RuntimeError):
    """A write or a connection failed; the message names the peer and region."""


class RemoteAccessError(TransportError):
    """The target NIC refused the write: wrong rkey, out of bounds, or region revoked."""


class PeerUnreachableError(TransportError):
    """The target is gone (process dead, link down, not connected)."""


class TransientTransportError(TransportError):
    """A fault that may clear by itself (a link that is down for now): the same WRITE may
    succeed when retried (see :mod:`weight_transfer.sender.retry`). Every other TransportError
    is permanent for the write that raised it."""


class LinkDownError(PeerUnreachableError, TransientTransportError):
    """The writer's or the target's link is down: transient, retried under the policy."""


class RetriesExhaustedError(TransportError):
    """A transient fault outlasted the retry policy; the message names NIC, peer, region."""


@runtime_checkable
class Transport(Protocol):
    """One NIC of one process. See the module docstring for the call order."""

    kind: str
    nic: str
    owner: str

    def register(self, buf: Any) -> RegionDesc:
        """Pin and expose ``buf`` (a tensor, numpy array or writable buffer)."""
        ...

    def deregister(self, desc: RegionDesc) -> None:
        """Revoke remote access to a region; later writes to it fail."""
        ...

    def peer_info(self, remote_owner: str, remote_nic: str | None = None) -> PeerInfo:
        """What NIC ``remote_nic`` of ``remote_owner`` needs to ``connect`` to this one.

        ``remote_nic`` None: any NIC of that owner (for owners with one NIC).
        """
        ...

    def connect(self, peer: PeerInfo) -> None:
        """Connect once to a peer, at setup."""
        ...

    async def write(self, src: Any, dst: RegionDesc, dst_offset: int = 0) -> None:
        """One-sided WRITE of all of ``src`` into ``dst`` at ``dst_offset`` bytes."""
        ...

    def close(self) -> None: ...

    # Optional capabilities: TransportBase gives each a default.
    supports_device_memory: bool
    registers_sources: bool
    bytes_written: int
    writes: int

    def register_source(self, buf: Any) -> Any:
        """Register memory that writes read from; a handle (None: nothing to register)."""
        ...

    def deregister_source(self, handle: Any) -> None: ...

    def check_peer(self, peer: PeerInfo) -> None:
        """ValueError naming the field if ``peer`` is not an endpoint this NIC can use."""
        ...

    def disconnect(self, owner: str, nic: str | None = None) -> int:
        """Close the connections to NIC ``nic`` of ``owner`` (None: all its NICs)."""
        ...

    def is_transient(self, exc: BaseException) -> bool:
        """Whether the WRITE that raised ``exc`` may succeed when tried again."""
        ...


@runtime_checkable
class FaultInjection(Protocol):
    """Optional: a NIC whose faults tests can inject (only simnic implements it)."""

    def set_link(self, up: bool) -> None:
        """Bring the link down (writes from and into the NIC fail) or up again."""
        ...

    def flap_link(self, down_s: float) -> None:
        """Bring the link down at the start of the next write, up ``down_s`` s later."""
        ...

    def fail_after_bytes(self, nbytes: int | None) -> None:
        """Deliver ``nbytes`` more bytes, then fail the write that needs more (None: off)."""
        ...


def fault_injection(nic: Any) -> FaultInjection:
    """``nic`` as a :class:`FaultInjection`; TypeError naming its transport if it is none."""
    if not isinstance(nic, FaultInjection):
        kind = getattr(nic, "kind", type(nic).__name__)
        where = f"{getattr(nic, 'owner', '?')}/{getattr(nic, 'nic', '?')}"
        raise TypeError(f"NIC {where} of transport {kind!r} cannot inject faults (set_link, "
                        "fail_after_bytes): only the simulated NIC 'simnic' implements "
                        "FaultInjection")
    return nic


def check_write_range(dst: RegionDesc, dst_offset: int, nbytes: int) -> None:
    """Local sanity check before a write leaves the NIC (the remote NIC checks again)."""
    if dst_offset < 0 or dst_offset + nbytes > dst.length:
        raise RemoteAccessError(
            f"write of {nbytes} B at offset {dst_offset} is outside {dst.describe()}"
        )


# --------------------------------------------------------------------------- the base class


class TransportOptions(StrictModel):
    """Base of every backend's options model: frozen, unknown names refused
    (:class:`~weight_transfer.config_files.StrictModel`), and strict about types too: an
    option reaches a NIC's constructor as it is, so ``"2"`` is not a number and ``1.5`` not
    an integer (YAML and Python both give typed values)."""

    model_config = ConfigDict(strict=True)


class TransportBase:
    """Defaults of the optional capabilities and the plumbing every backend shares.

    A backend sets ``kind`` and ``Options``, calls ``super().__init__(owner=..., nic=...)``
    and keeps its connections in the peer table (``_add_peer``; ``_release_peer`` closes
    one when it is dropped). See the module docstring.
    """

    kind: ClassVar[str] = ""
    Options: ClassVar[type[TransportOptions]] = TransportOptions
    registers_sources: ClassVar[bool] = False
    supports_device_memory: bool = False
    bytes_written: int = 0
    writes: int = 0
    refused_connections: int = 0  # connections the target side refused (tcp)
    refused_writes: int = 0  # writes the target side refused (tcp)
    owner: str = ""
    nic: str = ""
    label: str = "NIC ?/?"
    max_inflight: int = 1

    def __init__(self, *, owner: str, nic: str) -> None:
        self.owner, self.nic = owner, nic
        self.label = f"NIC {owner}/{nic}"
        self._peers: dict[tuple[str, str | None], Any] = {}
        self._peers_lock = threading.Lock()
        self._disconnected: set[tuple[str, str | None]] = set()
        self._sems: weakref.WeakKeyDictionary[Any, asyncio.Semaphore] = \
            weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ configuration

    @classmethod
    def open_kwargs(cls, options: TransportOptions, *, node: str = "",
                    address: str = "") -> dict[str, Any]:
        """Constructor keywords for a NIC of ``options`` on host ``address``, node ``node``."""
        return {**options.model_dump(), "node": node}

    @classmethod
    def reaches(cls, options: TransportOptions, src: Any, dst: Any) -> bool:
        """Whether a NIC on host ``src`` reaches one on another host ``dst`` (HostIds)."""
        return True

    @classmethod
    def unreachable_reason(cls, options: TransportOptions) -> str:
        """Why :meth:`reaches` said no, for the error that names the hosts."""
        return f"transport {cls.kind!r} reaches only NICs of its own host"

    # ------------------------------------------------------------------ capabilities

    def register_source(self, buf: Any) -> Any:
        """Nothing to register: this NIC sends from any memory (handle None)."""
        return None

    def deregister_source(self, handle: Any) -> None:
        """Release a :meth:`register_source` handle (nothing by default)."""

    def check_peer(self, peer: PeerInfo) -> None:
        """Endpoint fields are the backend's; by default only the transport is checked."""
        if peer.transport != self.kind:
            raise ValueError(f"{self.label} cannot connect to a {peer.transport!r} endpoint "
                             f"(peer {peer.owner}/{peer.nic})")

    def is_transient(self, exc: BaseException) -> bool:
        """Whether a WRITE that raised ``exc`` may succeed when tried again."""
        return isinstance(exc, TransientTransportError)

    def grant(self, remote_owner: str, remote_nic: str, regions: Any = None) -> None:
        """The plan lets NIC ``remote_nic`` of ``remote_owner`` write into ``regions``
        (addresses of this NIC's regions); called before ``peer_info`` for it. Backends
        that check writers per region (tcp) keep it; by default nothing."""

    def open_window(self) -> None:
        """The engine paused for an update (tcp: writes accepted until close_window)."""

    def close_window(self) -> None:
        """The engine resumes (tcp: writes refused from now on)."""

    def disconnect(self, owner: str, nic: str | None = None) -> int:
        """Close the connections to NIC ``nic`` of ``owner`` (None: every NIC of it);
        later writes to it raise PeerUnreachableError until ``connect`` again. Returns
        how many connections were closed (0: none was open)."""
        with self._peers_lock:
            keys = [k for k in self._peers if k[0] == owner and nic in (None, k[1])]
            dropped = [self._peers.pop(k) for k in keys]
            self._disconnected.update(keys)
            self._disconnected.add((owner, nic))
        for conn in dropped:
            self._release_peer(conn)
        return len(dropped)

    # ------------------------------------------------------------------ plumbing

    def _release_peer(self, conn: Any) -> None:
        """Close one dropped connection (the backend's; nothing by default)."""

    def _add_peer(self, owner: str, nic: str | None, conn: Any) -> Any:
        """Record the connection to ``owner``/``nic``; returns the one it replaces."""
        with self._peers_lock:
            old = self._peers.get((owner, nic))
            self._peers[(owner, nic)] = conn
            self._disconnected.discard((owner, nic))
            self._disconnected.discard((owner, None))
        return old

    def _peer(self, owner: str, nic: str | None) -> Any:
        with self._peers_lock:
            return self._peers.get((owner, nic))

    def _is_connected(self, conn: Any) -> bool:
        """Whether a table entry can carry writes (rdma: a QP made but not yet connected)."""
        return True

    def _peer_for(self, dst: RegionDesc) -> Any:
        """The connection a write into ``dst`` goes through; PeerUnreachableError if none."""
        key = (dst.owner, dst.nic)
        with self._peers_lock:
            conn = self._peers.get(key)
            gone = key in self._disconnected or (dst.owner, None) in self._disconnected
        if conn is not None and self._is_connected(conn):
            return conn
        if gone:
            raise PeerUnreachableError(
                f"{self.label} was disconnected from peer {dst.owner}/{dst.nic} (it was "
                f"removed); connect() again before writing into {dst.describe()}")
        raise PeerUnreachableError(
            f"{self.label} is not connected to peer {dst.owner}/{dst.nic} (target of "
            f"{dst.describe()}); exchange peer_info() and connect() both sides first")

    def _take_peers(self) -> list[Any]:
        """Empty the peer table (``close``); returns what it held."""
        with self._peers_lock:
            conns, self._peers = list(self._peers.values()), {}
        return conns

    def _check_region(self, dst: Any) -> None:
        """ValueError unless ``dst`` is a descriptor of a region of this transport."""
        if not isinstance(dst, RegionDesc):
            raise ValueError(f"{self.label}: write destination must be a RegionDesc, not "
                             f"{type(dst).__name__}")
        if dst.transport != self.kind:
            raise ValueError(f"{self.label}: {dst.describe()} belongs to transport "
                             f"{dst.transport!r}, not {self.kind!r}")

    def _check_destination(self, dst: Any, dst_offset: Any, nbytes: int) -> None:
        """Descriptor, offset type and bounds of a write, before anything is sent."""
        self._check_region(dst)
        if isinstance(dst_offset, bool) or not isinstance(dst_offset, int):
            raise ValueError(f"{self.label}: dst_offset must be an int, not {dst_offset!r}")
        check_write_range(dst, dst_offset, nbytes)

    def _semaphore(self) -> asyncio.Semaphore:
        """The ``max_inflight`` semaphore of the running event loop (one per loop)."""
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.max_inflight)
        return sem

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the NIC (each backend has its own)."""

