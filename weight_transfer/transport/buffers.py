"""The memory a write reads from or a NIC registers, resolved to (address, bytes).

:func:`source_buffer` takes a contiguous torch tensor (any dtype, float8
included), a contiguous numpy array, any writable or read-only buffer, or an
explicit ``(addr, nbytes)`` byte range; :func:`target_buffer` the same for memory
to register (writable, contiguous, not empty). Both return a :class:`SourceBuffer`
whose ``keepalive`` holds what must outlive the address. :class:`SourceTable` keeps
the sources a NIC that reads any host memory registered (simnic).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any


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


class SourceTable:
    """Memory a NIC's writes read from, registered once (``register_source``), for a NIC
    that can read any host memory but keeps the registrations honest: a handle per
    region, refused twice, and the bytes it sent from inside a registered region
    (``source_bytes``: zero-copy writes and staging arenas alike)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.Lock()
        self._regions: dict[int, SourceBuffer] = {}
        self._next = 1
        self.source_bytes = 0

    def add(self, buf: Any) -> int:
        mem = source_buffer(buf)
        if mem.nbytes == 0:
            raise ValueError(f"{self.label}: cannot register an empty source")
        with self._lock:
            handle, self._next = self._next, self._next + 1
            self._regions[handle] = mem
        return handle

    def remove(self, handle: int) -> None:
        with self._lock:
            if self._regions.pop(handle, None) is None:
                raise ValueError(f"{self.label}: no source registration {handle}")

    def ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) of every registered source."""
        with self._lock:
            return [(m.addr, m.nbytes) for m in self._regions.values()]

    def sent(self, mem: SourceBuffer) -> None:
        """Count a completed write's bytes when its source lies inside a registered one."""
        with self._lock:
            if any(r.addr <= mem.addr and mem.addr + mem.nbytes <= r.addr + r.nbytes
                   for r in self._regions.values()):
                self.source_bytes += mem.nbytes
