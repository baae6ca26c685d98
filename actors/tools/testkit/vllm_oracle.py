"""Test scaffolding for the vLLM engine: tiny checkpoints, engines and the byte oracle.

The oracle is independent of our recording and plan: in the worker it puts the
model back into vLLM's loading format (vLLM's layerwise-reload helpers),
materializes every layer, runs vLLM's own ``model.load_weights`` on a saved
checkpoint's real tensors, keeps the loaded tensors, and puts the engine's
tensors back untouched::

    hf, path = save_checkpoint("configs/models/tiny_moe.yaml", seed=1, root=tmp)
    llm = start_llm(path)                              # our backend, float32
    expected = llm.collective_rpc(oracle_load, args=(str(other_checkpoint),))[0]
    actual = llm.collective_rpc(registered_tensors)[0]    # our registered bytes
    problems, digests = llm.collective_rpc(oracle_check, args=(str(path),))[0]  # in the worker

Worker functions travel through ``collective_rpc`` as callables, which needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (:func:`start_llm` sets it; tests only).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import torch


@functools.cache
def vllm_missing() -> str | None:
    """Why vLLM cannot run here (None when it can)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build
        return f"vllm cannot be imported: {type(exc).__name__}: {exc}"
    return None


def save_checkpoint(model_yaml: str | Path, *, seed: int, root: str | Path,
                    dtype: torch.dtype = torch.float32):
    """A random Hugging Face model of ``model_yaml`` saved as safetensors; (model, path)."""
    from weight_transfer.engines.reference.hf_model import build_hf_model
    from weight_transfer.model.models import load_model_config

    cfg = load_model_config(model_yaml)
    cfg = cfg.model_copy(update={"torch_dtype": str(dtype).removeprefix("torch.")})
    model = build_hf_model(cfg, seed=seed, dtype=dtype)
    path = Path(root) / f"{cfg.name or cfg.architecture}-seed{seed}"
    model.save_pretrained(path)
    return model, path


def start_llm(path: str | Path, *, tp: int = 1, dtype: str = "float32", **kw: Any):
    """An ``LLM`` of ``path`` with our weight-transfer backend."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from weight_transfer.engines.vllm import BACKEND_NAME
    from weight_transfer.engines.vllm.driver import SMALL_ENGINE, executor_for

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tp))))
    return LLM(model=str(path), dtype=dtype, tensor_parallel_size=tp,
               weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME),
               **{**SMALL_ENGINE, "distributed_executor_backend": executor_for(tp), **kw})


def registered_tensors(worker) -> dict[str, torch.Tensor]:
    """Worker side: every tensor our backend registered, read from the registered memory
    (host or GPU), as CPU tensors of the registered shapes."""
    backend = worker.weight_transfer_engine
    out = {}
    for t in backend.meta.tensors:
        view = backend.views[t.name]
        if view.data_ptr() != t.region.addr + t.offset:
            raise RuntimeError(f"{t.name}: registered at {t.region.addr + t.offset:#x}, the "
                               f"backend's tensor is at {view.data_ptr():#x}")
        flat = view.detach().reshape(-1).view(torch.uint8)[:t.nbytes].cpu().clone()
        out[t.name] = flat.view(getattr(torch, t.dtype)).view(t.shape)
    return out


def oracle_load(worker, checkpoint: str) -> dict[str, torch.Tensor]:
    """Worker side: vLLM's own load_weights of ``checkpoint`` in loading format (every
    parameter, padding rows included); the engine's own tensors are left as they were."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
        _place_kernel_tensors,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.meta import materialize_layer
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    model = worker.model_runner.model
    weights = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        weights.update(load_file(f))
    with torch.no_grad(), torch.device(worker.device):
        initialize_layerwise_reload(model)
        try:
            for layer in model.modules():
                info = LAYERWISE_INFO[layer]
                materialize_layer(layer, info)
                for t in get_layer_tensors(layer).values():
                    if hasattr(t, "weight_loader"):
                        t.weight_loader = _get_original_loader(t)
                    t.data.zero_()
            model.load_weights(iter(weights.items()))
            out = {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            for layer in model.modules():
                info = LAYERWISE_INFO.get(layer)
                if info is not None and info.kernel_tensors is not None:
                    _place_kernel_tensors(layer, info)
                if info is not None:
                    info.reset()
    return out


def compare_to_oracle(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
                      ) -> list[str]:
    """Differences between registered tensors and the oracle's (cut to the registered
    rows), one line each; empty when every byte is equal."""
    problems = []
    for name, got in actual.items():
        want = expected.get(name)
        if want is None:
            problems.append(f"{name}: not a parameter vLLM loads")
            continue
        want = want[: got.shape[0]] if got.dim() else want
        if got.shape != want.shape or got.dtype != want.dtype:
            problems.append(f"{name}: {tuple(got.shape)} {got.dtype} vs oracle "
                            f"{tuple(want.shape)} {want.dtype}")
        elif not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
            bad = (got != want).sum().item()
            problems.append(f"{name}: {bad} elements differ from vLLM's load_weights")
    return problems


def oracle_check(worker, checkpoint: str) -> tuple[list[str], dict[str, str]]:
    """Worker side: (differences between our registered tensors and vLLM's load_weights of
    ``checkpoint``, sha256 of each registered tensor); no tensor leaves the worker."""
    actual = registered_tensors(worker)
    problems = compare_to_oracle(actual, oracle_load(worker, checkpoint))
    digests = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()
               for n, t in actual.items()}
    return problems, digests


def connect_link(link, meta, spec, *, trainer: str, nic: str):
    """A trainer-side NIC of ``spec`` connected both ways to TP rank 0 of ``link``."""
    return connect_nic(meta, spec, trainer=trainer, nic=nic,
                       endpoints=lambda reqs: link.call("endpoints", reqs, rank=0)[0],
                       connect=lambda conns: link.call("connect", conns, rank=0)[0])


def connect_rank(rank, meta, spec, *, trainer: str, nic: str):
    """A trainer-side NIC of ``spec`` connected both ways to an engine rank handle's NIC
    (``rank``: a ``VllmRank``, e.g. of a user's actor through ``vllm_replicas``)."""
    import ray

    return connect_nic(meta, spec, trainer=trainer, nic=nic,
                       endpoints=lambda reqs: ray.get(rank.wt_endpoints.remote(reqs)),
                       connect=lambda conns: ray.get(rank.wt_connect_peers.remote(conns)))


def connect_nic(meta, spec, *, trainer: str, nic: str, endpoints, connect):
    """A trainer-side NIC of ``spec`` connected both ways to the NIC of ``meta``'s first
    tensor: ``endpoints(requests)`` -> the engine's peer infos, ``connect(conns)`` -> the
    number of connections the engine made."""
    from weight_transfer.transport.handshake import Connection, Endpoint, InfoRequest

    engine_nic = meta.tensors[0].region.nic
    mine = spec.open(owner=trainer, nic=nic)
    request = InfoRequest(nic=engine_nic, remote=Endpoint(owner=trainer, nic=nic))
    (peer,) = endpoints([request])
    mine.connect(peer)
    conn = Connection(nic=engine_nic, peer=mine.peer_info(meta.tensors[0].region.owner,
                                                          engine_nic))
    if connect([conn]) != 1:
        raise RuntimeError(f"{meta.replica}: the engine did not connect back to {nic}")
    return mine


def write_update(nic, meta, state: dict[str, torch.Tensor]) -> int:
    """Write every recorded piece of ``meta`` from the trainer ``state`` (prepared as the
    trainers prepare it: casts, FP8 quantization); returns the bytes written."""
    from weight_transfer.model.checkpoint_names import to_trainer_pieces
    from weight_transfer.sender.prepare import piece_bytes

    pieces, missing = to_trainer_pieces(meta.pieces, {n: tuple(t.shape)
                                                      for n, t in state.items()})
    if missing:
        raise ValueError(f"checkpoint tensors no trainer parameter holds: {missing[:5]}")
    where = {t.name: t for t in meta.tensors}

    async def run() -> int:
        total = 0
        for p in pieces:
            t = where[p.dst_tensor]
            await nic.write(piece_bytes(state[p.src_param], p), t.region, t.offset + p.dst_offset)
            total += p.nbytes
        return total

    return asyncio.run(run())


def flip_registered_byte(worker, tensor: str, index: int) -> int:
    """Worker side: invert byte ``index`` of registered tensor ``tensor`` (a write that
    landed wrong, for integrity-check tests); returns the new byte."""
    flat = worker.weight_transfer_engine.views[tensor].reshape(-1).view(torch.uint8)
    flat[index] ^= 0xFF
    return int(flat[index])
