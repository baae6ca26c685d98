"""A rank's pipeline items, derived once from its static plan, and its own blocks.

:func:`group_layouts` cuts one mesh group of a rank's plan
(:class:`~weight_transfer.plan.check.GroupWork`) into the items the executor
(:mod:`weight_transfer.sender.executor`) runs in order: each shard-direct parameter
alone (``local``: no collective), then the gather buckets
(:func:`weight_transfer.sender.gather.plan_buckets`); each item knows its tasks, the
staging slot of each distinct piece, its watermark reservation and its bytes.
:func:`own_block` is the rank's block of a shard-direct parameter, placed in
global coordinates (:func:`weight_transfer.layout.shard_blocks.local_rect`)::

    layouts = group_layouts(group, gather_unit="bucket", bucket_bytes=64 << 20)
    tensor, rect = own_block(meta, dtensor, rank)   # dtensor.to_local(), its rectangle
    zero_copy_pieces(layouts_per_group, rank)       # name -> pieces cut with no copy
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_transfer.layout.flat_blocks import flat_range, is_flat
from weight_transfer.layout.shard_blocks import local_rect
from weight_transfer.layout.zero_copy import zero_copy_span
from weight_transfer.plan.check import GroupWork
from weight_transfer.sender.flat_shard import FlatShard
from weight_transfer.sender.gather import GatherBucket, plan_buckets, reserve_bytes
from weight_transfer.sender.staging import piece_slots
from weight_transfer.types import ParamMeta, Piece, WriteTask


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """What a bucket needs on this rank, derived once from the static plan: its parameters
    with their tasks, each distinct piece's offset in the bucket's staging lease, the lease
    size, the watermark reservation and the bytes it writes."""

    bucket: GatherBucket
    params: tuple[tuple[ParamMeta, tuple[WriteTask, ...]], ...]
    slots: dict[Piece, int]
    staged: int
    reserve: int
    nbytes: int
    local: bool = False  # shard-direct: pieces cut from the rank's own block, no collective


def bucket_layout(group: GroupWork, bucket: GatherBucket, *, local: bool = False
                  ) -> BucketLayout:
    params = tuple((m, tuple(group.tasks.get(m.name, []))) for m in bucket.params)
    tasks = [t for _, ts in params for t in ts]
    # A piece sent to several replicas is prepared once: it has one slot, reserved once.
    unique = list(dict.fromkeys(t.piece for t in tasks))
    offsets, staged = piece_slots([q.nbytes for q in unique])
    gather = 0 if local else reserve_bytes(bucket)
    return BucketLayout(
        bucket=bucket, params=params, slots=dict(zip(unique, offsets, strict=True)),
        staged=staged, reserve=gather + sum(q.nbytes for q in unique),
        nbytes=sum(t.nbytes for t in tasks), local=local)


def group_layouts(group: GroupWork, *, gather_unit: str, bucket_bytes: int
                  ) -> list[BucketLayout]:
    """A group's items in order: its shard-direct parameters one by one, then its gather
    buckets (the same on every rank of a mesh: a function of the plan and the metadata)."""
    local = [bucket_layout(group, GatherBucket(params=(m,), coalesced=False), local=True)
             for m in group.local]
    buckets = plan_buckets(group.params, mode=gather_unit, bucket_bytes=bucket_bytes)
    return local + [bucket_layout(group, b) for b in buckets]


def zero_copy_pieces(layouts: list[list[BucketLayout]], rank: int
                     ) -> dict[str, frozenset[Piece]]:
    """Per shard-direct parameter of the rank, the pieces it can write straight from its
    own memory (:func:`weight_transfer.layout.zero_copy.zero_copy_span`); parameters with
    none are left out."""
    out = {}
    for lay in (lay for group in layouts for lay in group if lay.local):
        for meta, tasks in lay.params:
            mine = frozenset(t.piece for t in tasks
                             if zero_copy_span(meta, t.piece, rank) is not None)
            if mine:
                out[meta.name] = mine
    return out


def own_block(meta: ParamMeta, local: Any, rank: int) -> tuple[Any, tuple | None]:
    """(the rank's own block of a parameter, where it sits in the global tensor): a
    DTensor's local tensor, or the block's rectangle of a plain tensor of the global
    shape; a flat partition (:class:`~weight_transfer.sender.flat_shard.FlatShard`) as it
    is, with no rectangle. ValueError naming the parameter and the rank if its shape (or
    range) is not what the metadata's placements give."""
    if isinstance(local, FlatShard) or is_flat(meta):
        return _own_range(meta, local, rank), None
    block = local_rect(meta, rank)
    tensor = local.to_local() if hasattr(local, "to_local") else local
    want = None if block is None else tuple(b - a for a, b in block)
    if want is not None and not hasattr(local, "to_local") and tuple(tensor.shape) == meta.shape:
        # a plain tensor of the global shape is the whole parameter (as gather_bucket takes it)
        tensor = tensor[tuple(slice(a, b) for a, b in block)]
    if want is None or tuple(tensor.shape) != want:
        raise ValueError(f"rank {rank}: parameter {meta.name!r} holds a local block of shape "
                         f"{tuple(tensor.shape)}, its placements {meta.placements} on mesh "
                         f"{meta.mesh.ranks} give {want}; it cannot be written shard-direct")
    return tensor, block


def _own_range(meta: ParamMeta, local: Any, rank: int) -> FlatShard:
    want = flat_range(meta, rank) if is_flat(meta) else None
    got = ((local.start, local.start + local.valid) if isinstance(local, FlatShard)
           else type(local).__name__)
    if want is None or got != want or tuple(local.shape) != meta.shape:
        raise ValueError(f"rank {rank}: parameter {meta.name!r} holds {got} of shape "
                         f"{tuple(getattr(local, 'shape', ()))}, its placements "
                         f"{meta.placements} on mesh {meta.mesh.ranks} give flat elements "
                         f"{want} of {meta.shape}; it cannot be written shard-direct")
    return local
