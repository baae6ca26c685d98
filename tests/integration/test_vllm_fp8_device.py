"""FP8 into a real vLLM on a CUDA GPU: an engine started from a block-FP8 checkpoint
(float8_e4m3fn weights, float32 weight_scale_inv) receives an update from a bf16 trainer
state by one-sided RDMA writes into GPU memory; the trainer quantizes into the layout
recorded from vLLM's load_weights. Every registered byte equals vLLM's own load_weights of
the FP8 checkpoint of the new weights, and the engine's greedy generations equal those of
a second vLLM engine started from that checkpoint (same bytes, same kernels).

Skipped here: vLLM's block FP8 needs a CUDA GPU (or AMX on CPU, which these CPUs lack);
the writes into GPU memory need an RDMA device (dma-buf). Run on a GPU host with vLLM
installed: ``pytest -m gpu tests/integration/test_vllm_fp8_device.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.tools.testkit.vllm_meta import save_fp8_model
from actors.tools.testkit.vllm_oracle import (
    compare_to_oracle,
    connect_link,
    oracle_load,
    registered_tensors,
    start_llm,
    write_update,
)

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm, pytest.mark.rdma,  # rdma: skipped without a device
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA GPU: vLLM's block FP8 needs one (or AMX on CPU)"),
]

LLAMA = Path(__file__).parents[2] / "configs" / "models" / "tiny_llama.yaml"
PROMPTS = [[1, 5, 9, 200], [7, 7, 3], [42]]


def test_fp8_update_into_vllm_on_gpu(tmp_path):
    from safetensors.torch import load_file

    from weight_transfer.engines.vllm.driver import VllmLink
    from weight_transfer.engines.vllm.mailbox import SetupRequest
    from weight_transfer.transport.options import parse_transport
    from weight_transfer.types import Transform

    first = save_fp8_model(LLAMA, seed=1, root=tmp_path)
    new = save_fp8_model(LLAMA, seed=2, root=tmp_path)
    spec = parse_transport("rdma", None, where="test")
    link = VllmLink(start_llm(first, dtype="bfloat16", gpu_memory_utilization=0.2))
    try:
        (meta,) = link.setup(SetupRequest(replica="engine0", nics=(("inode0/nic0",),),
                                          transport=spec))
        assert {p.transform for p in meta.pieces} == set(Transform)
        nic = connect_link(link, meta, spec, trainer="trainer0", nic="tnode0/nic0")
        link.pause()
        state = load_file(new / "bf16.safetensors.src")  # the trainer's bf16 weights
        assert write_update(nic, meta, state) == sum(t.nbytes for t in meta.tensors)
        link.resume(version=2)
        assert link.version() == "2"
        actual = link.llm.collective_rpc(registered_tensors)[0]
        expected = link.llm.collective_rpc(oracle_load, args=(str(new),))[0]
        assert compare_to_oracle(actual, expected) == []
        got = link.generate(PROMPTS, 8)
    finally:
        link.close()
    other = VllmLink(start_llm(new, dtype="bfloat16", gpu_memory_utilization=0.2))
    try:
        assert got == other.generate(PROMPTS, 8)
    finally:
        other.close()
