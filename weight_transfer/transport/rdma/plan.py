"""Device-independent arithmetic of the RDMA transport: work requests, MR lookup, dma-buf.

- :func:`split_write` cuts one write into work requests no larger than the
  device's maximum message size (``port_attr.max_msg_sz``) or a chosen chunk.
- :class:`LocalRegions` finds the local MR that covers a source byte range, so a
  write from registered memory posts with that MR's lkey (and its iova: a
  dma-buf MR is addressed by offsets, not by virtual addresses).
- :func:`dmabuf_range` rounds a GPU byte range out to whole pages, as
  ``cuMemGetHandleForAddressRange`` requires, and says where the tensor starts.

Pure: no pyverbs, no CUDA; unit-tested everywhere.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """One RDMA WRITE work request: local bytes ``[src, src+length)`` to remote ``dst``."""

    src: int
    dst: int
    length: int


def split_write(*, src: int, dst: int, nbytes: int, max_bytes: int) -> list[Chunk]:
    """Cut ``nbytes`` from ``src`` to ``dst`` into chunks of at most ``max_bytes``."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    if nbytes < 0:
        raise ValueError(f"cannot write a negative number of bytes ({nbytes})")
    return [
        Chunk(src=src + off, dst=dst + off, length=min(max_bytes, nbytes - off))
        for off in range(0, nbytes, max_bytes)
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalRegion:
    """A local MR as the sender uses it: virtual range, lkey, and its address base.

    ``iova`` is the address the MR is addressed by in work requests: the virtual
    address for an ordinary MR, the dma-buf offset for a dma-buf MR.
    """

    va: int
    length: int
    lkey: int
    iova: int

    def sge_addr(self, va: int) -> int:
        """The work-request address of virtual address ``va`` inside this MR."""
        return self.iova + (va - self.va)


class LocalRegions:
    """Local MRs by virtual address; finds one that covers a whole byte range."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[LocalRegion] = []

    def __len__(self) -> int:
        return len(self._regions)

    def add(self, region: LocalRegion) -> None:
        if region.length <= 0:
            raise ValueError(f"local region {region} is empty")
        i = bisect.bisect_right(self._starts, region.va)
        self._starts.insert(i, region.va)
        self._regions.insert(i, region)

    def remove(self, region: LocalRegion) -> None:
        for i in range(bisect.bisect_left(self._starts, region.va), len(self._regions)):
            if self._regions[i] == region:
                del self._starts[i], self._regions[i]
                return
            if self._starts[i] > region.va:
                break
        raise KeyError(f"local region {region} is not registered")

    def find(self, va: int, nbytes: int) -> LocalRegion | None:
        """An MR containing ``[va, va+nbytes)``, or None (overlapping MRs: any that fits)."""
        end = va + nbytes
        for i in range(bisect.bisect_right(self._starts, va) - 1, -1, -1):
            region = self._regions[i]
            if region.va + region.length >= end:
                return region
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class DmaBufRange:
    """Page-aligned span to export as a dma-buf, and where the tensor lies inside it."""

    base: int  # page-aligned device address where the dma-buf starts
    span: int  # bytes exported, a whole number of pages
    offset: int  # tensor start inside the dma-buf (= the MR's iova)


def dmabuf_range(ptr: int, nbytes: int, page: int) -> DmaBufRange:
    """Round ``[ptr, ptr+nbytes)`` out to ``page`` boundaries."""
    if page <= 0 or page & (page - 1):
        raise ValueError(f"page size {page} must be a power of two")
    if ptr <= 0 or nbytes <= 0:
        raise ValueError(f"bad device range (ptr={ptr:#x}, nbytes={nbytes})")
    base = ptr & ~(page - 1)
    offset = ptr - base
    span = (offset + nbytes + page - 1) & ~(page - 1)
    return DmaBufRange(base=base, span=span, offset=offset)
