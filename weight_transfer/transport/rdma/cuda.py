"""Export GPU memory as a dma-buf fd (CUDA driver API through ctypes) for a dma-buf MR.

GPU memory is registered with ``ibv_reg_dmabuf_mr`` on a dma-buf that
``cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)``
exports. The range must be page-aligned, so the exported span is the tensor's
range rounded out to host pages (:func:`~weight_transfer.transport.rdma.plan.dmabuf_range`;
it stays inside the ``cudaMalloc`` segment, whose size is a multiple of 2 MiB);
the MR then covers exactly the tensor's bytes, ``[offset, offset + nbytes)`` of
the dma-buf, so a remote writer cannot touch neighbouring tensors::

    span = export_dmabuf(tensor.data_ptr(), nbytes, device=tensor.device.index)
    mr = DmaBufMR(pd, nbytes, access, dmabuf=span.fd, offset=span.offset)
    ...                               # RegionDesc.addr = span.offset (the MR's iova)
    mr.close(); os.close(span.fd)

Needs the NVIDIA driver (``libcuda.so.1``) and dma-buf support (open kernel
modules, Linux >= 5.12); otherwise :class:`CudaDmaBufError` says which is missing.
:func:`dmabuf_unsupported_reason` asks the same without exporting anything (the
rdma transport's ``supports_device_memory`` follows it).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

from weight_transfer.errors import WeightTransferError
from weight_transfer.transport.rdma.plan import dmabuf_range

CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
LIBCUDA_NAMES = ("libcuda.so.1", "libcuda.so")


class CudaDmaBufError(WeightTransferError, RuntimeError):
    """GPU memory cannot be exported as a dma-buf (no driver, no support, bad range)."""


@dataclass(frozen=True, slots=True)
class DmaBufSpan:
    """An exported dma-buf: its fd (the caller closes it) and the tensor's offset in it."""

    fd: int
    offset: int
    span: int


def load_libcuda(names: tuple[str, ...] = LIBCUDA_NAMES) -> ctypes.CDLL:
    errors = []
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
            continue
        for fn in ("cuInit", "cuDeviceGet", "cuDeviceGetAttribute",
                   "cuMemGetHandleForAddressRange", "cuGetErrorString"):
            getattr(lib, fn).restype = ctypes.c_int
        return lib
    raise CudaDmaBufError(
        f"cannot register GPU memory for RDMA: the CUDA driver library could not be loaded "
        f"({'; '.join(errors)}); GPU (dma-buf) registration needs the NVIDIA driver"
    )


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc == 0:
        return
    text = ctypes.c_char_p()
    lib.cuGetErrorString(rc, ctypes.byref(text))
    msg = text.value.decode() if text.value else "unknown error"
    raise CudaDmaBufError(f"{what} failed: CUDA error {rc} ({msg})")


def _check_dmabuf_device(cu: ctypes.CDLL, device: int) -> None:
    _check(cu, cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(cu, cu.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
    supported = ctypes.c_int()
    _check(cu, cu.cuDeviceGetAttribute(
        ctypes.byref(supported), CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev
    ), "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)")
    if not supported.value:
        raise CudaDmaBufError(
            f"CUDA device {device} cannot export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED"
            "=0): GPU memory registration needs the open NVIDIA kernel modules and Linux >= 5.12"
        )


def dmabuf_unsupported_reason(device: int = 0, lib: ctypes.CDLL | None = None) -> str | None:
    """Why GPU ``device``'s memory cannot be registered through dma-buf, or None if it can."""
    if lib is None:
        return _cached_reason(device)
    try:
        _check_dmabuf_device(lib, device)
    except CudaDmaBufError as exc:
        return str(exc)
    return None


@functools.cache
def _cached_reason(device: int) -> str | None:
    try:
        return dmabuf_unsupported_reason(device, load_libcuda())
    except CudaDmaBufError as exc:
        return str(exc)


def export_dmabuf(
    ptr: int, nbytes: int, *, device: int, lib: ctypes.CDLL | None = None
) -> DmaBufSpan:
    """Export the pages holding ``[ptr, ptr+nbytes)`` of CUDA device ``device`` as a dma-buf."""
    rng = dmabuf_range(ptr, nbytes, os.sysconf("SC_PAGE_SIZE"))
    cu = lib if lib is not None else load_libcuda()
    _check_dmabuf_device(cu, device)
    fd = ctypes.c_int(-1)
    rc = cu.cuMemGetHandleForAddressRange(
        ctypes.byref(fd), ctypes.c_uint64(rng.base), ctypes.c_size_t(rng.span),
        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ctypes.c_ulonglong(0),
    )
    _check(cu, rc, f"cuMemGetHandleForAddressRange(base={rng.base:#x}, size={rng.span}) "
                   f"for {nbytes} B at {ptr:#x} on cuda:{device}")
    return DmaBufSpan(fd=fd.value, offset=rng.offset, span=rng.span)
