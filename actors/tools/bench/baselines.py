"""The common weight-update designs, run on the same trainer and engine actors as ours.

``wt bench designs`` (:mod:`actors.tools.bench.designs.bench`) runs these inside the
existing actors with ``actor.__ray_call__.remote(fn, ...)``, so the actors need
no extra methods; each function's first argument is the actor instance.

* ``rank0`` (OpenRLHF, verl): every trainer rank gathers each parameter
  (``full_tensor()``), trainer rank 0 broadcasts it over a gloo group of rank 0
  and every engine rank, each engine rank loads it.
* ``bucketed`` (checkpoint-engine style): rank 0 packs gathered parameters into
  fixed-size buckets and broadcasts one bucket while it gathers the next
  (two buckets, asynchronous gloo broadcast).
* ``rpc``: rank 0 calls every engine rank's ``update_weight(name, tensor)``
  through Ray for every parameter (the tensor travels as the call's argument).
* ``native`` (OpenRLHF's own, DeepSpeed ZeRO-3 trainers): ``rank0`` where each
  parameter's gather is ``deepspeed.zero.GatheredParameters`` (every design gathers a
  ZeRO-3 model that way: :func:`_gathered`); on Megatron-core trainers slime's own:
  ``rank0`` where each parameter is all-gathered over TP and converted to Hugging Face
  tensors (every design gathers a Megatron model that way:
  :mod:`actors.tools.bench.baselines_megatron`).

The engine-side load is the reference engine's layout: each received Hugging
Face tensor is cut into this rank's fused and sharded tensors (the same
``Piece`` rectangles vLLM's ``load_weights`` narrows, from
:func:`weight_transfer.layout.engine_layout.engine_pieces`), and the caller verifies
the result against the independent reference loader. Every send and receive
is paced by :class:`actors.tools.bench.pacing.NicPacer` at the simnic cap; see
that module for the model. Per-process state (the group, the pacer, the
pieces) lives in :data:`_STATE` of the actor's process.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ray
import torch
import torch.distributed as dist

from actors.groups import host_store, node_ip
from actors.tools.bench.baselines_megatron import gathered as gathered_megatron
from actors.tools.bench.baselines_megatron import megatron_model
from actors.tools.bench.baselines_megatron import params as params_megatron
from actors.tools.bench.pacing import (
    BucketEntry,
    NicPacer,
    bucket_nbytes,
    gloo_broadcast_sends,
)
from weight_transfer.layout.engine_layout import engine_pieces
from weight_transfer.model.naming import canonical_trainer_name
from weight_transfer.sender.prepare import as_bytes, piece_bytes

log = logging.getLogger(__name__)
_STATE: dict[str, Any] = {}


# ------------------------------------------------------------------ set-up (once)


def set_cap(actor: Any, gbps: float | None) -> None:
    """This process's NIC pacer at ``gbps`` (None: uncapped)."""
    _STATE["pacer"] = NicPacer(gbps)


def nic_bytes(actor: Any) -> dict[str, int]:
    pacer = _STATE.get("pacer")
    return dict(pacer.bytes) if pacer is not None else {"tx": 0, "rx": 0}


def serve_group_store(actor: Any) -> tuple[str, int]:
    """Trainer rank 0: a TCPStore for the broadcast group; (host, port)."""
    host = node_ip()
    _STATE["store_server"] = store = host_store(host=host)
    return host, store.port


def join_group(actor: Any, host: str, port: int, rank: int, size: int,
               timeout_s: float = 300.0) -> None:
    """Join the broadcast group (trainer rank 0 is rank 0); a second, private gloo group."""
    store = _STATE.get("store_server") if rank == 0 else None
    if store is None:
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    _STATE["group"] = dist.ProcessGroupGloo(dist.PrefixStore("wt-bench", store), rank, size,
                                            datetime.timedelta(seconds=timeout_s))
    _STATE["group_rank"], _STATE["group_size"] = rank, size


def engine_prepare(actor: Any, expert_naming: str) -> int:
    """Index this engine rank's pieces by source parameter; returns their count."""
    engine = actor.engine
    pieces = engine_pieces(engine.cfg, engine.shard, fp8=engine.fp8, expert_naming=expert_naming)
    by_src = defaultdict(list)
    for p in pieces:
        by_src[p.src_param].append(p)
    _STATE["pieces"] = dict(by_src)
    return len(pieces)


def engine_zero(actor: Any) -> None:
    """Clear every weight byte (so the next design must write all of them)."""
    actor.engine.buffer.zero_()


def _load(actor: Any, name: str, full: torch.Tensor) -> None:
    """The engine-side load of one HF tensor: cut it into this rank's engine tensors."""
    tensors = actor.engine.tensors
    for p in _STATE["pieces"].get(name, ()):
        as_bytes(tensors[p.dst_tensor])[p.dst_offset : p.dst_offset + p.nbytes] = \
            piece_bytes(full, p)


# ------------------------------------------------------------------ trainer side


def _gathered(trainer: Any):
    """(canonical name, full tensor) of every parameter, in order (a collective)."""
    model = trainer._wt_require_model()
    if zero3_partitioned(model):
        yield from _gathered_zero3(model)
        return
    if megatron_model(model):
        yield from gathered_megatron(model, trainer.config.model.vocab_size, trainer._wt_rank)
        return
    for key, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        yield canonical_trainer_name(key), full.detach().contiguous()


def zero3_partitioned(model: Any) -> bool:
    """A DeepSpeed ZeRO-3 model (its parameters' ``ds_tensor`` hold the partitions)."""
    return any(getattr(p, "ds_tensor", None) is not None for p in model.parameters())


def _gathered_zero3(model: Any):
    """OpenRLHF's own gather (``native``): one ``deepspeed.zero.GatheredParameters`` per
    parameter, an all-gather of the whole parameter on every rank; the tensor is used
    inside the context (broadcast, packed or sent), as OpenRLHF broadcasts it there."""
    import deepspeed

    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            yield canonical_trainer_name(name), p.data


def _paced_broadcast(tensor: torch.Tensor, *, wait: bool = True) -> tuple[Any, float]:
    """Start a broadcast from group rank 0, book its bytes; (work, deadline)."""
    rank, size, pg = _STATE["group_rank"], _STATE["group_size"], _STATE["group"]
    n = tensor.numel() * tensor.element_size()
    sends = gloo_broadcast_sends(rank, size)
    deadline = _STATE["pacer"].book(tx=sends * n, rx=0 if rank == 0 else n)
    work = pg.broadcast(tensor, 0)
    if wait:
        work.wait()
        NicPacer.wait_until(deadline)
    return work, deadline


def trainer_gather_only(trainer: Any) -> int:
    """The floor every design shares: gather every parameter, send nothing; returns bytes."""
    return sum(full.numel() * full.element_size() for _, full in _gathered(trainer))


def trainer_rank0(trainer: Any) -> int:
    """``rank0``: gather each parameter, rank 0 broadcasts it; returns bytes broadcast."""
    sent = 0
    for _, full in _gathered(trainer):
        if trainer._wt_rank == 0:
            _paced_broadcast(full)
            sent += full.numel() * full.element_size()
    return sent


def trainer_bucketed(trainer: Any, buckets: list[list[BucketEntry]]) -> int:
    """``bucketed``: pack into two alternating buckets; broadcast one while filling the next."""
    size = max(bucket_nbytes(b) for b in buckets)
    bufs = [torch.empty(size, dtype=torch.uint8) for _ in range(2)] \
        if trainer._wt_rank == 0 else []
    pending: list[tuple[Any, float] | None] = [None, None]
    params = _gathered(trainer)
    sent = 0
    for i, bucket in enumerate(buckets):
        for entry in bucket:
            name, full = next(params)
            if name != entry.name:
                raise RuntimeError(f"bucketed: parameter {name} where the layout has "
                                   f"{entry.name} (trainer rank {trainer._wt_rank})")
            if trainer._wt_rank != 0:
                continue
            if entry is bucket[0] and pending[i % 2] is not None:
                _finish(pending[i % 2])  # the buffer's previous broadcast must be done
                pending[i % 2] = None
            bufs[i % 2][entry.offset : entry.offset + entry.nbytes] = as_bytes(full)
        if trainer._wt_rank == 0:
            n = bucket_nbytes(bucket)
            pending[i % 2] = _paced_broadcast(bufs[i % 2][:n], wait=False)
            sent += n
    for p in pending:
        if p is not None:
            _finish(p)
    return sent


def _finish(pending: tuple[Any, float]) -> None:
    work, deadline = pending
    work.wait()
    NicPacer.wait_until(deadline)


def trainer_rpc(trainer: Any, engines: list[Any], timeout_s: float = 600.0,
                call: Callable[..., Any] | None = None) -> int:
    """``rpc``: rank 0 calls every engine's update_weight(name, tensor) per parameter
    (``call(engine, name, tensor)`` run in each of ``engines``; the reference engine's
    :func:`engine_update_weight` unless given)."""
    call = engine_update_weight if call is None else call
    sent = 0
    for name, full in _gathered(trainer):
        if trainer._wt_rank != 0:
            continue
        n = full.numel() * full.element_size()
        deadline = _STATE["pacer"].book(tx=n * len(engines))
        ray.get([e.__ray_call__.remote(call, name, full) for e in engines],
                timeout=timeout_s)
        NicPacer.wait_until(deadline)
        sent += n * len(engines)
    return sent


# ------------------------------------------------------------------ engine side


def engine_update_weight(actor: Any, name: str, tensor: torch.Tensor) -> None:
    """``rpc``: the engine's ``update_weight(name, tensor)``; receive paced, then load."""
    deadline = _STATE["pacer"].book(rx=tensor.numel() * tensor.element_size())
    _load(actor, name, tensor)
    NicPacer.wait_until(deadline)


def engine_rank0(actor: Any, params: list[tuple[str, tuple[int, ...], str]]) -> int:
    """``rank0``: receive every parameter of ``params`` in order and load it."""
    return receive_rank0(params, lambda weights: [_load(actor, n, t) for n, t in weights])


def engine_bucketed(actor: Any, buckets: list[list[BucketEntry]]) -> int:
    """``bucketed``: receive each bucket, load the parameters packed in it."""
    return receive_bucketed(buckets, lambda weights: [_load(actor, n, t) for n, t in weights])


Loader = Callable[[list[tuple[str, torch.Tensor]]], Any]


def receive_rank0(params: list[tuple[str, tuple[int, ...], str]], load: Loader) -> int:
    """An engine rank's side of ``rank0``: receive each parameter of ``params`` in order
    from the broadcast group's rank 0, ``load([(name, tensor)])`` it; returns bytes."""
    got = 0
    for name, shape, dtype in params:
        buf = torch.empty(shape, dtype=getattr(torch, dtype))
        _paced_broadcast(buf)
        load([(name, buf)])
        got += buf.numel() * buf.element_size()
    return got


def receive_bucketed(buckets: list[list[BucketEntry]], load: Loader) -> int:
    """An engine rank's side of ``bucketed``: receive each bucket, ``load`` the parameters
    packed in it (one call per bucket); returns bytes."""
    buf = torch.empty(max(bucket_nbytes(b) for b in buckets), dtype=torch.uint8)
    got = 0
    for bucket in buckets:
        n = bucket_nbytes(bucket)
        _paced_broadcast(buf[:n])
        load([(e.name, buf[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype))
               .view(e.shape)) for e in bucket])
        got += n
    return got


# ------------------------------------------------------------------ helpers for the driver


def trainer_params(trainer: Any) -> dict[str, Any]:
    """Parameters in gather order, ``(name, global shape, dtype, nbytes)``, and expert naming."""
    from weight_transfer.model.live_metadata import expert_naming_of

    model = trainer._wt_require_model()
    if megatron_model(model):
        return {"params": params_megatron(model, trainer.config.model.vocab_size),
                "expert_naming": "per_expert"}
    tensors = (model.named_parameters() if zero3_partitioned(model)
               else model.state_dict().items())
    params = [(canonical_trainer_name(k), tuple(_full_shape(t)),
               str(t.dtype).removeprefix("torch."), math.prod(_full_shape(t)) * t.element_size())
              for k, t in tensors]
    return {"params": params, "expert_naming": expert_naming_of(model)}


def _full_shape(t: Any) -> tuple[int, ...]:
    """A parameter's global shape (ZeRO-3's ``ds_shape``; a DTensor's own shape)."""
    return tuple(getattr(t, "ds_shape", None) or t.shape)


def set_simnic_cap(trainer: Any, gbps: float | None) -> None:
    """Re-cap this trainer's simnic (ours) at ``gbps`` between updates (None: uncapped)."""
    from weight_transfer.transport.simnic.nic import SimNic

    nic = trainer.wt_nic
    if not isinstance(nic, SimNic):
        raise RuntimeError(f"trainer rank {trainer._wt_rank}: no simnic to re-cap")
    nic.set_bandwidth(gbps)  # changed while no write runs
