"""The transport protocol every data-plane backend implements.

One object is one NIC of one process. The life of a transfer:

1. the target registers memory (``register``) and publishes the returned
   :class:`RegionDesc` through the control plane (plain data);
2. both sides exchange :class:`PeerInfo` once, each made for the other NIC
   (``peer_info(remote_owner, remote_nic)`` / ``connect``; see
   :mod:`.handshake` for a whole cluster at once);
3. the writer issues one-sided ``write`` calls; the target runs no code;
   completion and errors come back to the writer only;
4. ``deregister`` revokes remote access; ``close`` releases the NIC.

Backends: ``simnic`` (simulated NIC, the default without RDMA hardware),
``rdma`` (pyverbs RC queue pairs), ``mooncake`` (Mooncake TransferEngine).

Errors: :class:`RemoteAccessError` (wrong rkey, out of bounds, revoked) and
:class:`PeerUnreachableError` (peer dead, not connected) are permanent;
:class:`TransientTransportError` (simnic: :class:`LinkDownError`) may clear and
is retried by the executor under its ``RetryPolicy``; when it does not clear,
:class:`RetriesExhaustedError` names the NIC, the peer and the region.

Fault injection (link down, fail after N bytes) is an optional interface,
:class:`FaultInjection`, that only simnic implements; callers get it through
:func:`fault_injection`, which names the transport that lacks it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from weight_transfer.errors import WeightTransferError
from weight_transfer.types import PeerInfo, RegionDesc


class TransportError(WeightTransferError, RuntimeError):
    """A write or a connection failed; the message names the peer and region."""


class RemoteAccessError(TransportError):
    """The target NIC refused the write: wrong rkey, out of bounds, or region revoked."""


class PeerUnreachableError(TransportError):
    """The target is gone (process dead, link down, not connected)."""


class TransientTransportError(TransportError):
    """A fault that may clear by itself (a link that is down for now): the same WRITE may
    succeed when retried (see :mod:`weight_transfer.retry`). Every other TransportError
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


@dataclass(frozen=True, slots=True)
class SourceBuffer:
    """A local source of a write as raw bytes: address, length, and what keeps it alive."""

    addr: int
    nbytes: int
    keepalive: Any


def source_buffer(src: Any) -> SourceBuffer:
    """Resolve a write source to (address, nbytes).

    Accepts a contiguous torch tensor (any dtype, float8 included: its bytes
    are sent as they are), a contiguous numpy array, any object exposing the
    buffer protocol, or an explicit ``(addr, nbytes)`` byte range whose memory
    the caller keeps alive.
    """
    if isinstance(src, tuple) and len(src) == 2 and all(isinstance(v, int) for v in src):
        addr, nbytes = src
        if addr <= 0 or nbytes < 0:
            raise ValueError(f"bad source byte range (addr={addr:#x}, nbytes={nbytes})")
        return SourceBuffer(addr, nbytes, None)
    if hasattr(src, "data_ptr") and hasattr(src, "element_size"):  # torch.Tensor
        if not src.is_contiguous():
            raise ValueError(
                f"source tensor of shape {tuple(src.shape)} is not contiguous; "
                "call .contiguous() first"
            )
        return SourceBuffer(src.data_ptr(), src.numel() * src.element_size(), src)
    if hasattr(src, "__array_interface__"):  # numpy array
        if not src.flags["C_CONTIGUOUS"]:
            raise ValueError(f"source array of shape {src.shape} is not C-contiguous")
        return SourceBuffer(src.__array_interface__["data"][0], src.nbytes, src)
    try:
        view = memoryview(src)
    except TypeError:
        raise ValueError(
            f"cannot write from {type(src).__name__}: pass a tensor, an array, a buffer "
            "or an (addr, nbytes) tuple"
        ) from None
    if not view.contiguous:
        raise ValueError("source buffer is not contiguous")
    nbytes = view.nbytes
    if nbytes == 0:
        return SourceBuffer(0, 0, view)
    if view.readonly:
        # ctypes cannot take the address of a read-only buffer without a copy.
        copy = bytearray(view.cast("B"))
        return SourceBuffer(ctypes.addressof(ctypes.c_char.from_buffer(copy)), nbytes, copy)
    c = ctypes.c_char.from_buffer(view.cast("B"))
    return SourceBuffer(ctypes.addressof(c), nbytes, (view, c))


def target_buffer(buf: Any) -> SourceBuffer:
    """Resolve memory to register (must be writable and contiguous)."""
    if hasattr(buf, "__array_interface__") and not buf.flags["WRITEABLE"]:
        raise ValueError("cannot register a read-only array")
    if isinstance(buf, bytes | memoryview) and memoryview(buf).readonly:
        raise ValueError("cannot register read-only memory")
    out = source_buffer(buf)
    if out.nbytes == 0:
        raise ValueError("cannot register an empty buffer")
    return out


def check_write_range(dst: RegionDesc, dst_offset: int, nbytes: int) -> None:
    """Local sanity check before a write leaves the NIC (the remote NIC checks again)."""
    if dst_offset < 0 or dst_offset + nbytes > dst.length:
        raise RemoteAccessError(
            f"write of {nbytes} B at offset {dst_offset} is outside {dst.describe()}"
        )
