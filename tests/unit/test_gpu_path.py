"""The CUDA path of a trainer step: pinned host-to-device copy and quantization on the GPU.

Skipped without CUDA (these machines have none); run on a GPU host with
``pytest -m gpu``.
"""

import pytest
import torch

from weight_transfer.layout.quant import quantize_fp8_blocks
from weight_transfer.sender.bucket_prepare import to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def test_h2d_from_pinned_memory_is_exact():
    host = torch.randn(1024, 1024, dtype=torch.bfloat16).pin_memory()
    dev = to_device(host, torch.device("cuda"))
    torch.cuda.synchronize()
    assert dev.is_cuda
    assert torch.equal(dev.cpu(), host)


@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (4, 256, 128)])
def test_gpu_quantization_is_bit_identical_to_cpu(shape):
    w = torch.randn(*shape, dtype=torch.bfloat16) * 3
    q_cpu, s_cpu = quantize_fp8_blocks(w)
    q_gpu, s_gpu = quantize_fp8_blocks(w.cuda())
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)
