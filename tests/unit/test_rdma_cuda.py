"""GPU memory as a dma-buf: driver loading, the driver calls made, the errors raised.

``FakeCuda`` stands in for libcuda: it answers the four driver calls through
the same ctypes ``byref`` arguments and records what it was asked, so the
arguments (page-aligned base, whole-page size, dma-buf handle type) are checked
here; the real export runs in the ``gpu`` test.
"""

from __future__ import annotations

import os

import pytest

from weight_transfer.transport.rdma.cuda import (
    CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
    CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
    CudaDmaBufError,
    export_dmabuf,
    load_libcuda,
)

PAGE = os.sysconf("SC_PAGE_SIZE")


class FakeCuda:
    def __init__(self, *, supported: int = 1, export_rc: int = 0, fd: int = 42):
        self.supported, self.export_rc, self.fd = supported, export_rc, fd
        self.calls: list[tuple] = []

    def cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return 0

    def cuDeviceGet(self, ref, ordinal):
        ref._obj.value = 100 + ordinal
        return 0

    def cuDeviceGetAttribute(self, ref, attr, dev):
        self.calls.append(("attr", attr, dev.value))
        ref._obj.value = self.supported
        return 0

    def cuMemGetHandleForAddressRange(self, ref, base, size, handle_type, flags):
        self.calls.append(("export", base.value, size.value, handle_type, flags.value))
        if self.export_rc == 0:
            ref._obj.value = self.fd
        return self.export_rc

    def cuGetErrorString(self, rc, ref):
        ref._obj.value = b"invalid argument"
        return 0


def test_export_asks_for_the_page_aligned_span_as_a_dmabuf_fd():
    cu = FakeCuda(fd=7)
    ptr = 0x7F00_0000_0000 + PAGE + 0x40
    span = export_dmabuf(ptr, 3 * PAGE, device=1, lib=cu)
    assert (span.fd, span.offset, span.span) == (7, 0x40, 4 * PAGE)
    assert ("attr", CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, 101) in cu.calls
    assert ("export", ptr - 0x40, 4 * PAGE, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) in cu.calls


def test_device_without_dmabuf_support_is_named():
    with pytest.raises(CudaDmaBufError, match="CUDA device 3 cannot export dma-bufs"):
        export_dmabuf(0x10000, 100, device=3, lib=FakeCuda(supported=0))


def test_driver_error_names_the_range_and_the_cuda_error():
    with pytest.raises(CudaDmaBufError) as err:
        export_dmabuf(0x10000, 100, device=0, lib=FakeCuda(export_rc=1))
    msg = str(err.value)
    assert "cuMemGetHandleForAddressRange" in msg and "100 B at 0x10000 on cuda:0" in msg
    assert "CUDA error 1 (invalid argument)" in msg


def test_missing_driver_library_is_a_clear_error():
    with pytest.raises(CudaDmaBufError, match="CUDA driver library could not be loaded"):
        load_libcuda(("libcuda-does-not-exist.so.1",))


@pytest.mark.gpu
def test_real_export_of_a_cuda_tensor_gives_a_dmabuf_fd():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    try:
        span = export_dmabuf(t.data_ptr(), t.numel() * 4, device=t.device.index)
    except CudaDmaBufError as exc:
        pytest.skip(f"dma-buf export unsupported here: {exc}")
    try:
        with open(f"/proc/self/fdinfo/{span.fd}") as f:
            fdinfo = f.read()
        assert "exp_name" in fdinfo  # the kernel knows the fd as a dma-buf
        assert span.span % PAGE == 0 and span.offset + t.numel() * 4 <= span.span
    finally:
        os.close(span.fd)
