"""Coalesced gathers: a bucket of sharded parameters in one collective per sharded mesh dim.

``DTensor.full_tensor()`` is one collective (per sharded mesh dim) per
parameter; over gloo between CPU processes each costs a round trip, and a model
has hundreds of small parameters (norms, biases). This module groups a mesh
group's parameters, in the plan's gather order, into buckets and gathers each
bucket at once:

1. :func:`plan_buckets` (pure, metadata only, in :mod:`weight_transfer.sender.buckets`
   so that planning and the simulator use it without torch) cuts the gather
   order into runs of consecutive parameters with the same mesh and the same
   placements, each ``Shard(d)`` or ``Replicate()`` with at least one shard
   (FSDP2's 1-D ``(Shard(0),)``, HSDP's ``(Replicate(), Shard(0))``, EP x FSDP
   stacked experts' ``(Shard(0), Shard(1))``), whose gather holds at most
   ``bucket_bytes`` of temporary memory (:func:`reserve_bytes`; a parameter
   larger than that alone is a bucket of one); any other parameter
   (``Partial``, all ``Replicate``, plain tensors) is a bucket of its own that
   falls back to ``full_tensor()``. The buckets are a function of the plan and
   the parameter metadata only, so every rank of a mesh cuts the same buckets
   and issues the same collectives in the same order (``bucket_bytes`` must be
   the same on every rank).
2. :func:`gather_bucket` (a collective). FSDP2's 1-D ``(Shard(0),)`` (the fast
   path): it pads each local shard to ``ceil(dim0 / world)`` rows (FSDP2 shards
   dim 0 as ``torch.chunk`` does, the last ranks hold fewer or no rows),
   concatenates their bytes, runs one ``all_gather_into_tensor`` (NCCL) or
   ``all_gather`` into views of one buffer (gloo), and cuts each full tensor
   out of the rank-major result: the first ``dim0`` rows of the per-rank padded
   chunks, in rank order. Every other coalescible layout goes through
   :func:`weight_transfer.sender.gather_nd.gather_nd`: the same, once per sharded mesh
   dim, innermost first, over that dim's group, along the sharded tensor dim.
   Either way the result equals ``full_tensor()`` bit for bit. ZeRO-3's flat
   partitions (``(Flat(),)``, :class:`~weight_transfer.sender.flat_shard.FlatShard`)
   go through :func:`weight_transfer.sender.flat_shard.gather_flat`: one ``all_gather``
   of the padded partitions over their group.

Memory: :func:`reserve_bytes` is what a bucket holds at its peak, for the
watermark: the padded local input, the ``world x`` padded gather buffer and the
full tensors cut from it, at the level (sharded mesh dim) where that is
largest (per-parameter buckets: the full tensor only, as before)::

    buckets = plan_buckets(group_params, mode="bucket", bucket_bytes=64 << 20)
    for b in buckets:
        fulls = gather_bucket(b, [params[m.name] for m in b.params], record=log)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from weight_transfer.layout.flat_blocks import is_flat
from weight_transfer.sender.buckets import (  # the pure planning half, re-exported
    _ALIGN,
    DEFAULT_BUCKET_BYTES,
    GATHER_MODES,
    GatherBucket,
    coalescible,
    plan_buckets,
    reserve_bytes,
    shard_rows,
)
from weight_transfer.sender.flat_shard import FlatShard, all_gather_rows, gather_flat
from weight_transfer.sender.gather_nd import gather_nd
from weight_transfer.types import ParamMeta, Placement

__all__ = ["DEFAULT_BUCKET_BYTES", "GATHER_MODES", "GatherBucket", "coalescible",
           "full_tensor", "gather_bucket", "plan_buckets", "reserve_bytes", "shard_rows"]

_SHARD0 = (Placement(kind="shard", dim=0),)


def full_tensor(local: Any) -> torch.Tensor:
    """The whole parameter: ``DTensor.full_tensor()`` (a collective) or the tensor itself."""
    gather = getattr(local, "full_tensor", None)
    return gather() if gather is not None else local


Recorder = Callable[[tuple], None]


def gather_bucket(bucket: GatherBucket, locals_: Sequence[Any], *,
                  record: Recorder | None = None) -> list[torch.Tensor]:
    """The full tensors of ``bucket``'s parameters (a collective on every rank of its mesh).

    ``locals_`` are the rank's parameters in bucket order (DTensors, or plain full
    tensors, which need no collective). ``record`` is called with one tuple per
    collective issued: ``("all_gather", names, nbytes)`` (1-D ``Shard(0)``),
    ``("all_gather", names, nbytes, mesh_dim)`` (one per sharded mesh dim of an
    N-D bucket, innermost first) or ``("full_tensor", name)``.
    """
    if len(locals_) != len(bucket.params):
        raise ValueError(f"bucket {bucket.key!r}: {len(bucket.params)} parameters but "
                         f"{len(locals_)} local tensors")
    out: list[Any] = list(locals_)
    live = [i for i, x in enumerate(locals_) if hasattr(x, "full_tensor")]
    fast, gather = _coalesced(bucket, locals_, live)
    if fast:
        for i, full in zip(fast, gather([locals_[i] for i in fast],
                                        [bucket.params[i] for i in fast], record),
                           strict=True):
            out[i] = full
    for i in live:
        if i not in fast:
            if record is not None:
                record(("full_tensor", bucket.params[i].name))
            out[i] = locals_[i].full_tensor()
    for m, full in zip(bucket.params, out, strict=True):
        if tuple(full.shape) != m.shape:
            raise ValueError(f"parameter {m.name!r} gathered as {tuple(full.shape)}, "
                             f"metadata says {m.shape}")
    return out


def _coalesced(bucket: GatherBucket, locals_: Sequence[Any],
               live: list[int]) -> tuple[list[int], Callable]:
    """Which of the bucket's parameters one coalesced gather takes, and that gather.

    FSDP2's 1-D ``(Shard(0),)`` keeps its fast path (one ``all_gather``, for two or
    more parameters); any other coalescible layout goes through :func:`gather_nd`
    (one ``all_gather`` per sharded mesh dim, for one or more). Both decisions use
    global shapes and placements only, so every rank of the mesh takes the same.
    """
    if not bucket.coalesced:
        return [], _all_gather
    if is_flat(bucket.params[0]):  # ZeRO-3 partitions: one all_gather over their group
        fast = [i for i in live if isinstance(locals_[i], FlatShard)]
        return fast, _flat
    if _is_shard0_1d(bucket.params[0]):
        fast = [i for i in live if _is_dtensor(locals_[i]) and _live_shard0(locals_[i])]
        return (fast if len(fast) > 1 else []), _all_gather
    fast = [i for i in live if _is_dtensor(locals_[i]) and locals_[i].numel() > 0]
    return fast, gather_nd


def _flat(shards: Sequence[FlatShard], metas: Sequence[ParamMeta],
          record: Recorder | None) -> list[torch.Tensor]:
    return gather_flat(shards, [m.name for m in metas], record)


def _is_shard0_1d(meta: ParamMeta) -> bool:
    return len(meta.mesh.shape) == 1 and meta.placements == _SHARD0


def _is_dtensor(x: Any) -> bool:
    return hasattr(x, "full_tensor") and hasattr(x, "to_local") and hasattr(x, "device_mesh")


def _live_shard0(x: Any) -> bool:
    from torch.distributed.tensor import Shard

    return (x.device_mesh.ndim == 1 and tuple(x.placements) == (Shard(0),)
            and x.dim() >= 1 and x.shape[0] > 0)


def _all_gather(dts: Sequence[Any], metas: Sequence[ParamMeta],
                record: Recorder | None) -> list[torch.Tensor]:
    mesh = dts[0].device_mesh
    if any(d.device_mesh != mesh for d in dts):
        raise ValueError(f"bucket of {metas[0].name!r}: parameters on different meshes")
    group, world, rank = mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0)
    layout = []  # (offset, padded bytes, bytes per row) per parameter
    total = 0
    for d in dts:
        row = d.numel() * d.element_size() // d.shape[0]
        chunk = -(-d.shape[0] // world) * row
        layout.append((total, chunk, row))
        total += -(-chunk // _ALIGN) * _ALIGN  # every dtype's view starts aligned
    device = dts[0].to_local().device
    inp = torch.zeros(total, dtype=torch.uint8, device=device)
    for d, m, (off, _, row) in zip(dts, metas, layout, strict=True):
        local = d.to_local()
        want = shard_rows(d.shape[0], world, rank)
        if local.shape[0] != want:
            raise ValueError(f"rank {rank} of the mesh: parameter {m.name!r} holds "
                             f"{local.shape[0]} rows of dim 0, chunking {d.shape[0]} rows "
                             f"over {world} ranks gives {want}")
        inp[off : off + want * row] = local.contiguous().reshape(-1).view(torch.uint8)
    rows = all_gather_rows(inp, group, world, [m.name for m in metas], record)
    fulls = []
    for d, (off, chunk, row) in zip(dts, layout, strict=True):
        flat = rows[:, off : off + chunk].reshape(-1)[: d.shape[0] * row]
        fulls.append(flat.view(d.dtype).view(tuple(d.shape)))
    return fulls

