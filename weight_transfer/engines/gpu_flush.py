"""Make remote RDMA WRITEs into GPU memory visible to the GPU's kernels before they read.

A WRITE that completed at its writer has reached the target NIC and PCIe, but on
a GPU target the GPU may still see stale bytes until the writes are flushed
(GPUDirect RDMA's ordering rules: "the CUDA driver does not guarantee that RDMA
writes become visible to subsequent CUDA work" without a flush). Before an engine
rank lets kernels read freshly written weights (an in-place resume, or a flip in
shadow mode) it calls :func:`flush_gpudirect_writes`:

1. ``cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
   CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)`` through ctypes on ``libcuda``
   (CUDA >= 11.3) where the driver has it, after making ``device`` current;
2. otherwise ``torch.cuda.synchronize(device)`` (the ordering that a device-wide
   synchronization gives: the fallback of drivers without the entry point).

Memory on the host needs nothing (a completed WRITE is in host memory):
:func:`flush_gpudirect_writes` returns ``"none"`` for a CPU device. Returns
which path ran (``"cuFlushGPUDirectRDMAWrites"``, ``"synchronize"`` or
``"none"``).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)

CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX = 0
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER = 100
LIBCUDA_NAMES = ("libcuda.so.1", "libcuda.so")


@functools.cache
def _flush_entry() -> object | None:
    """``cuFlushGPUDirectRDMAWrites`` of the loaded driver, or None where there is none."""
    for name in LIBCUDA_NAMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = getattr(lib, "cuFlushGPUDirectRDMAWrites", None)
        if fn is None:
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_int]
        return fn
    return None


def flush_gpudirect_writes(device: torch.device | str | int | None) -> str:
    """Flush completed RDMA WRITEs into ``device``'s memory before its kernels read them;
    returns the path taken (module docstring). RuntimeError when the driver call fails."""
    dev = torch.device("cpu" if device is None else device)
    if isinstance(device, int):
        dev = torch.device("cuda", device)
    if dev.type != "cuda":
        return "none"
    fn = _flush_entry()
    if fn is not None:
        with torch.cuda.device(dev):
            torch.cuda.current_stream(dev)  # makes the primary context current
            rc = fn(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                    CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)
        if rc != 0:
            raise RuntimeError(f"cuFlushGPUDirectRDMAWrites on {dev} failed: CUDA error {rc}")
        return "cuFlushGPUDirectRDMAWrites"
    log.debug("no cuFlushGPUDirectRDMAWrites in the driver: synchronizing %s instead", dev)
    torch.cuda.synchronize(dev)
    return "synchronize"
