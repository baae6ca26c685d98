"""The common weight-update designs against a real vLLM engine: the engine side in vLLM's workers.

``wt bench designs --engine vllm`` (:mod:`actors.tools.bench.designs.vllm`) runs the
trainer side of each design exactly as against the reference engine
(:mod:`actors.tools.bench.baselines`: the same gathers, the same gloo broadcasts, the same
:class:`~actors.tools.bench.pacing.NicPacer`). The engine side runs here, inside
every vLLM worker process, through ``LLM.collective_rpc(fn, args)`` (what
OpenRLHF's and verl's worker extensions do): each function's first argument
is vLLM's worker. One update of a baseline design, per replica:

1. the owner opens vLLM's update session (:meth:`VllmEngineOwner.pause`:
   the engine stops at a step boundary, ``LLM.start_weight_update``);
2. :func:`worker_enter` (``collective_rpc``) puts every layer that vLLM
   repacks on CPU back into vLLM's loading format, the way vLLM's own
   layerwise reload does (``restore_layer_on_meta`` + ``materialize_layer``),
   except that each loading-format parameter is the memory our backend
   registered for it (its repack arena) and carries vLLM's original weight
   loader (as vLLM's layerwise reload replays buffered loads with): they write
   exactly where the trainers' one-sided writes land in ``p2p``. Layers vLLM
   computes with directly (norms, the embedding) are loaded in place;
3. the transfer, every received Hugging Face tensor loaded with vLLM's own
   ``model.load_weights`` (fusion, TP slicing and vocabulary padding are
   vLLM's weight loaders'):

   * ``rank0`` (OpenRLHF, verl): each worker joins the gloo group of trainer
     rank 0 and every engine rank (:func:`worker_join`, once); per parameter
     it receives the broadcast and calls ``load_weights([(name, tensor)])``
     (:func:`worker_rank0`);
   * ``bucketed`` (checkpoint-engine): per bucket one broadcast, then one
     ``load_weights`` of the bucket's tensors (:func:`worker_bucketed`);
   * ``rpc``: trainer rank 0 calls, per parameter, the owner's
     ``update_weight(name, tensor)`` through Ray (:func:`owner_update_weight`,
     one call per replica, as vLLM's API is per ``LLM``: the trainer's NIC
     sends each tensor once per replica); the owner passes the tensor to every
     worker with ``collective_rpc`` (vLLM's own IPC, shared memory on the
     replica's host), the receive is booked once per replica (on TP rank 0's
     NIC) and every worker loads it (:func:`worker_update_weight`);

4. :func:`worker_leave` puts the kernel tensors back (vLLM's
   ``_place_kernel_tensors``);
5. the owner closes the session (``LLM.finish_weight_update``): our backend
   runs the same reprocess step as after a ``p2p`` update (vLLM's
   ``process_weights_after_loading`` of the repacked layers, from the arena,
   into the tensors the kernels hold), so every design ends in the same
   engine state.

Worker-process state (the group, the pacer, the kernel tensors set aside)
lives in :data:`actors.tools.bench.baselines._STATE` and :data:`_LOADING` of that process.
``collective_rpc`` with a function needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
(the vLLM demo's engines set it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import actors.tools.bench.baselines as B
from actors.tools.bench.pacing import BucketEntry, NicPacer

log = logging.getLogger(__name__)
_LOADING: dict[str, Any] = {}  # worker process: layers in loading format, while loading


# ------------------------------------------------------------------ set-up (once)


def _backend(worker: Any) -> Any:
    backend = getattr(worker, "weight_transfer_engine", None)
    if backend is None or getattr(backend, "meta", None) is None:
        raise RuntimeError("vLLM worker: our weight-transfer backend is not set up "
                           "(the controller's setup() registers its memory first)")
    return backend


def worker_join(worker: Any, host: str, port: int, first_rank: int, size: int) -> int:
    """Join the broadcast group as rank ``first_rank`` + this worker's TP rank."""
    rank = first_rank + _backend(worker).shard.tp_rank
    B.join_group(worker, host, port, rank, size)
    return rank


def worker_set_cap(worker: Any, gbps: float | None) -> None:
    B.set_cap(worker, gbps)


def worker_nic_bytes(worker: Any) -> dict[str, int]:
    return B.nic_bytes(worker)


def worker_zero(worker: Any) -> int:
    """Zero every tensor our backend registered (what ``p2p`` writes); returns bytes."""
    views = _backend(worker).views
    with torch.no_grad():
        for view in views.values():
            view.zero_()
    return sum(v.numel() * v.element_size() for v in views.values())


# ------------------------------------------------------------------ loading format


def _repacked_layers(worker: Any) -> dict[torch.nn.Module, dict[str, torch.Tensor]]:
    """{layer vLLM repacks: {parameter: its registered loading-format memory}}, decided by
    the backend's own rule (:func:`weight_transfer.engines.vllm.memory.reprocessed`)."""
    from vllm.platforms import current_platform

    from weight_transfer.engines.vllm.memory import reprocessed

    model = worker.model_runner.model
    modules = dict(model.named_modules())
    head = getattr(model, "lm_head", None)
    out: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
    for name, view in _backend(worker).views.items():
        owner, pname = name.rsplit(".", 1)
        module = modules[owner]
        if reprocessed(module, on_cpu=current_platform.is_cpu(), lm_head=head):
            out.setdefault(module, {})[pname] = view
    return out


def worker_enter(worker: Any) -> int:
    """Put the repacked layers into loading format on their registered memory (step 2 of
    the module docstring); returns how many layers."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    from weight_transfer.engines.vllm.memory import loading_format

    if _LOADING:
        raise RuntimeError("vLLM worker: worker_enter twice without worker_leave")
    layers = _repacked_layers(worker)
    with torch.no_grad():
        for layer, views in layers.items():
            loading_format(layer)
            for t in get_layer_tensors(layer).values():  # vLLM's loaders, not the
                if hasattr(t, "weight_loader"):  # layerwise wrappers recording left
                    t.weight_loader = _get_original_loader(t)
            for pname, view in views.items():
                param = getattr(layer, pname)
                if tuple(param.shape) != tuple(view.shape) or param.dtype != view.dtype:
                    raise RuntimeError(f"vLLM worker: {type(layer).__name__}.{pname} loads "
                                       f"{tuple(param.shape)} {param.dtype}, registered "
                                       f"{tuple(view.shape)} {view.dtype}")
                param.data = view
    _LOADING["layers"] = layers
    return len(layers)


def worker_leave(worker: Any) -> int:
    """Put the kernel tensors back (step 4); the arena keeps what was loaded."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        _place_kernel_tensors,
        get_layerwise_info,
    )

    layers = _LOADING.pop("layers", None)
    if layers is None:
        raise RuntimeError("vLLM worker: worker_leave without worker_enter")
    for layer in layers:
        info = get_layerwise_info(layer)
        _place_kernel_tensors(layer, info)
        info.reset()
    return len(layers)


def _loader(worker: Any) -> B.Loader:
    model = worker.model_runner.model

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        if "layers" not in _LOADING:
            raise RuntimeError("vLLM worker: load_weights outside worker_enter/worker_leave")
        with torch.no_grad():
            model.load_weights(weights=iter(weights))

    return load


# ------------------------------------------------------------------ the designs, engine side


def worker_rank0(worker: Any, params: list[tuple[str, tuple[int, ...], str]]) -> int:
    """``rank0``: receive each parameter, ``load_weights`` it; returns bytes received."""
    return B.receive_rank0(params, _loader(worker))


def worker_bucketed(worker: Any, buckets: list[list[tuple]]) -> int:
    """``bucketed``: receive each bucket, ``load_weights`` its tensors; returns bytes.
    ``buckets`` as :func:`plain_buckets` (``collective_rpc`` turns dataclasses into dicts)."""
    entries = [[BucketEntry(name=n, offset=o, shape=tuple(s), dtype=d, nbytes=b)
                for n, o, s, d, b in bucket] for bucket in buckets]
    return B.receive_bucketed(entries, _loader(worker))


def plain_buckets(buckets: list[list[BucketEntry]]) -> list[list[tuple]]:
    """Buckets as (name, offset, shape, dtype, nbytes) rows, for :func:`worker_bucketed`."""
    return [[(e.name, e.offset, e.shape, e.dtype, e.nbytes) for e in b] for b in buckets]


def worker_update_weight(worker: Any, name: str, raw: bytes, dtype: str,
                         shape: tuple[int, ...]) -> int:
    """``rpc``: this worker's part of ``update_weight(name, tensor)``: receive, load.
    The tensor crossed the network once, into the replica's driver (the owner); its
    receive is booked on TP rank 0's NIC, the one the driver's host shares; vLLM hands
    it to the workers through shared memory. It arrives as its bytes (``collective_rpc``
    hands untyped tensors over as lists)."""
    first = _backend(worker).shard.tp_rank == 0
    deadline = B._STATE["pacer"].book(rx=len(raw) if first else 0)
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype))
    _loader(worker)([(name, tensor.view(shape))])
    NicPacer.wait_until(deadline)
    return len(raw)


# ------------------------------------------------------------------ in the owner's process


def owner_update_weight(owner: Any, name: str, tensor: torch.Tensor) -> None:
    """``rpc``: the engine's ``update_weight(name, tensor)``: every worker loads it."""
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    owner.collective_rpc(worker_update_weight, (name, raw, str(tensor.dtype).removeprefix(
        "torch."), tuple(tensor.shape)))


def owner_begin(owner: Any) -> None:
    """Steps 1-2: open vLLM's update session, loading format in every worker."""
    owner.wt_pause(0)
    owner.collective_rpc(worker_enter)


def owner_finish(owner: Any, version: str) -> None:
    """Steps 4-5: kernel tensors back, close the session (our backend reprocesses)."""
    owner.collective_rpc(worker_leave)
    for rank in range(owner.tp):
        owner.wt_resume(rank, version)
