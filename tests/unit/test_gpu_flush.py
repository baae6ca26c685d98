"""Flushing GPUDirect RDMA writes before kernels read, and the flip on a GPU.

The CUDA tests skip without a device (these machines have none); run on a GPU host with
``pytest -m gpu``. On the host the flush is a no-op by design (a completed WRITE is in
host memory).
"""

import pytest
import torch

from weight_transfer.engines.gpu_flush import flush_gpudirect_writes
from weight_transfer.engines.shadow.store import scratch_for, swap_chunked

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device on this machine: the GPUDirect flush and a "
                                 "device-to-device swap need one")


def test_host_memory_needs_no_flush():
    assert flush_gpudirect_writes(None) == "none"
    assert flush_gpudirect_writes("cpu") == "none"


@pytest.mark.gpu
@cuda
def test_the_flush_runs_on_a_gpu_through_the_driver_or_a_synchronize():
    assert flush_gpudirect_writes(torch.device("cuda", 0)) in (
        "cuFlushGPUDirectRDMAWrites", "synchronize")
    assert flush_gpudirect_writes(0) in ("cuFlushGPUDirectRDMAWrites", "synchronize")


@pytest.mark.gpu
@cuda
def test_a_device_swap_is_exact():
    a = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, device="cuda")
    b = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, device="cuda")
    a0, b0 = a.clone(), b.clone()
    swap_chunked(a, b, scratch_for([a], 1 << 20))
    torch.cuda.synchronize()
    assert torch.equal(a, b0) and torch.equal(b, a0)
