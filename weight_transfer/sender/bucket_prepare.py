"""The prepare stage of a rank's transfer: one bucket's parameters into the pieces it writes.

:class:`~weight_transfer.sender.executor.RankTransfer` runs :func:`prepare_bucket` on its
gather thread for each :class:`BucketWork` in turn. A gather bucket is gathered
with one collective per sharded mesh dim (:func:`weight_transfer.sender.gather.gather_bucket`);
a shard-direct parameter (the group's ``local``, :mod:`scheduling.build.direct`) is an
item of its own with no collective: :func:`local_fulls` takes the rank's own block
of it (``DTensor.to_local()``, which :func:`weight_transfer.layout.shard_blocks.local_rect`
places in global coordinates) and the pieces are cut with their sources shifted
into that block, so the same bytes land as from the gathered tensor (a ZeRO-3 flat
partition: each piece from a strided view of the partition, :func:`piece_sources`). The pieces
are written into the bucket's staging lease when it has one
(:func:`weight_transfer.sender.prepare.prepare_pieces_into`, or ``prepare`` in its place:
a delta run's :meth:`~weight_transfer.sender.delta.write.DeltaStage.prepare_into`, which
makes FP8 pieces from their source's changes; with ``write_from_views`` a piece
that already is a contiguous host slice of a gathered tensor stays a view, and a
piece of the rank's own block does where it is zero-copy, ``ParamWork.zero_copy``:
:mod:`weight_transfer.sender.zero_copy.sources`), else allocated afresh::

    work = BucketWork(layout=layout, params=[ParamWork(meta=m, tasks=list(ts))
                                             for m, ts in layout.params])
    prepare_bucket(work, rank=0, write_from_views=True)   # fills each ParamWork.prepared

:func:`bucket_items` makes a group's pipeline items for one update; :func:`to_device`
is the ``h2d`` stage's copy of a local shard to the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_transfer.layout.shard_blocks import shifted
from weight_transfer.sender.flat_shard import FlatShard, flat_view
from weight_transfer.sender.gather import GatherBucket, gather_bucket
from weight_transfer.sender.pipeline import PipelineItem
from weight_transfer.sender.prepare import prepare_pieces, prepare_pieces_into
from weight_transfer.sender.rank_items import BucketLayout, own_block
from weight_transfer.sender.staging import Lease
from weight_transfer.types import ParamMeta, Piece, WriteTask


@dataclass(slots=True)
class ParamWork:
    """One parameter moving through the stages on this rank."""

    meta: ParamMeta
    tasks: list[WriteTask]
    local: Any = None  # local shard (Tensor or DTensor)
    prepared: list[torch.Tensor] = field(default_factory=list)
    # pieces to write straight from the registered source (sender.zero_copy.sources), and
    # those that were: their bytes are views of the trainer's own memory
    zero_copy: frozenset[Piece] = frozenset()
    direct: set[Piece] = field(default_factory=set)


@dataclass(slots=True)
class BucketWork:
    """One gather bucket (one parameter, or several gathered at once) on this rank."""

    layout: BucketLayout
    params: list[ParamWork]
    lease: Lease | None = None  # its pieces' range of the staging arena
    encoded: dict | None = None  # a delta run: its pieces' records, encoded where prepared

    @property
    def bucket(self) -> GatherBucket:
        return self.layout.bucket

    @property
    def tasks(self) -> list[WriteTask]:
        return [t for p in self.params for t in p.tasks]


Full = tuple[torch.Tensor, tuple | None]  # a tensor, and its block (None: the whole parameter)


def local_fulls(work: BucketWork, rank: int) -> list[Full]:
    """A shard-direct item's parameters: each the rank's own block and where it sits."""
    return [own_block(p.meta, p.local, rank) for p in work.params]


def gathered_fulls(work: BucketWork, record: Callable[[tuple], None] | None = None
                   ) -> list[Full]:
    """A gather bucket's parameters, gathered whole (``record``: each collective issued)."""
    return [(f, None) for f in gather_bucket(work.bucket, [p.local for p in work.params],
                                             record=record)]


def prepare_bucket(work: BucketWork, *, rank: int, write_from_views: bool,
                   record: Callable[[tuple], None] | None = None,
                   prepare: Callable[..., list[torch.Tensor]] | None = None) -> BucketWork:
    """Gather (or take the own blocks of) ``work``'s parameters and cut every piece this
    rank writes, into the bucket's lease when it has one; drops the local shards."""
    fulls = local_fulls(work, rank) if work.layout.local else gathered_fulls(work, record)
    slot = work.layout.slots  # each distinct piece's own range of the bucket's lease
    cuda = None
    for p, (full, block) in zip(work.params, fulls, strict=True):
        p.local = None
        mine = list(dict.fromkeys(t.piece for t in p.tasks))
        ready: dict = {}
        for source, qs, src in piece_sources(full, block, mine):
            if work.lease is not None:
                outs = [work.lease.buf[slot[q] : slot[q] + q.nbytes] for q in qs]
                if prepare is not None and not source.is_cuda:  # (pieces and their sources)
                    got = prepare(source, qs, src, outs, views=write_from_views)  # a delta run
                else:
                    views = _views(work, p, qs, write_from_views and not source.is_cuda)
                    got = prepare_pieces_into(source, src, outs, views=views)
                p.direct.update(q for q, g, o in zip(qs, got, outs, strict=True)
                                if q in p.zero_copy and g.data_ptr() != o.data_ptr())
            else:
                got = prepare_pieces(source, src)
            ready.update(zip(qs, got, strict=True))
            cuda = source.device if source.is_cuda else cuda
        p.prepared = [ready[t.piece] for t in p.tasks]
    if cuda is not None:
        torch.cuda.current_stream(cuda).synchronize()
    return work


def _views(work: BucketWork, p: ParamWork, pieces: list[Piece], gathered: bool
           ) -> bool | list[bool]:
    """Which pieces stay views of their source: of a gathered tensor, all that can
    (``gathered``); of the rank's own memory, only the zero-copy ones of a registered,
    fenced source."""
    if not work.layout.local:
        return gathered
    if not p.zero_copy:
        return False
    return [q in p.zero_copy for q in pieces]


def bucket_items(layouts: list[BucketLayout], *, direct: dict[str, frozenset[Piece]],
                 full_reserve: bool = False) -> list[PipelineItem]:
    """Fresh per-update work for each bucket of a group (the layouts are static):
    ``direct`` the pieces each parameter writes zero-copy this update, which reserve no
    watermark bytes (``full_reserve``: they do, as in serial mode, where every item must
    stay oversized to run alone)."""
    items = []
    for lay in layouts:
        params = [ParamWork(meta=m, tasks=list(ts), zero_copy=direct.get(m.name, frozenset()))
                  for m, ts in lay.params]
        free = 0 if full_reserve else sum(q.nbytes for p in params for q in p.zero_copy)
        items.append(PipelineItem(key=lay.bucket.key, reserve_bytes=lay.reserve - free,
                                  payload=BucketWork(layout=lay, params=params),
                                  nbytes=lay.nbytes))
    return items


def piece_sources(full: Any, block: tuple | None, pieces: list[Piece]):
    """``(tensor, pieces, their sources relative to it)`` to prepare ``pieces`` from: the
    gathered tensor, a local block (sources shifted into it), or per distinct source
    rectangle a strided view of a flat partition (ZeRO-3: the rectangles the plan gave
    this rank lie inside its range)."""
    if not pieces:
        return []
    if isinstance(full, FlatShard):
        by_rect: dict[tuple, list[Piece]] = {}
        for q in pieces:  # an FP8 weight piece and its scale piece share one view
            by_rect.setdefault(q.src_slice, []).append(q)
        return [(flat_view(full, rect), qs, [shifted(q, rect) for q in qs])
                for rect, qs in by_rect.items()]
    return [(full, pieces, pieces if block is None else [shifted(q, block) for q in pieces])]


def to_device(local: Any, device: torch.device) -> Any:
    """Host-to-device copy of a local shard (pinned memory makes it asynchronous): a
    DTensor's local tensor, or anything else's own ``to`` (a tensor, a ZeRO-3 flat
    partition, a Megatron TP block)."""
    to_local = getattr(local, "to_local", None)
    if to_local is None or getattr(local, "device_mesh", None) is None:
        return local.to(device, non_blocking=True)
    from torch.distributed.tensor import DTensor

    shard = to_local().to(device, non_blocking=True)
    return DTensor.from_local(
        shard, local.device_mesh, local.placements, run_check=False,
        shape=local.shape, stride=local.stride(),
    )
