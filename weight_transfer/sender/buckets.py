"""Gather buckets from metadata alone: which parameters one collective gathers together.

The pure half of :mod:`weight_transfer.sender.gather` (no torch), shared by the
executor, which gathers each bucket with one collective per sharded mesh
dimension, and the simulator (:mod:`scheduling.sim.stages`), which replays the
same buckets as pipeline items::

    buckets = plan_buckets(group_params, mode="bucket", bucket_bytes=64 << 20)
    [b.key for b in buckets], [reserve_bytes(b) for b in buckets]

A bucket is a run of consecutive parameters (in the plan's gather order) with
the SAME mesh and the SAME placements, each placement ``Shard(d)`` (any tensor
dim) or ``Replicate()`` with at least one shard (:func:`coalescible`: FSDP2's
``(Shard(0),)``, HSDP's ``(Replicate(), Shard(0))``, EP x FSDP stacked
experts' ``(Shard(0), Shard(1))``; ZeRO-3's ``(Flat(),)``), whose gather holds at most
``bucket_bytes`` of temporary memory; any other parameter (``Partial``, all
``Replicate``) is a bucket of its own (``full_tensor()``). Every rank of a mesh
cuts the same buckets.

Memory (:func:`reserve_bytes`): the gather un-shards the sharded mesh dims
innermost first. Un-sharding level ``j`` (mesh dim of size ``m_j``) packs the
rank's blocks, padded to ``ceil(n / m_j)`` along the sharded tensor dim and
aligned, into one input ``P_j`` bytes long, gathers ``m_j * P_j`` bytes and cuts
the blocks of level ``j - 1`` out of it (``B_{j-1}`` bytes; level -1: the full
tensors) before it frees the input and the gather buffer. Its peak is
``(m_j + 1) * P_j + B_{j-1}``; the bucket's is the largest over levels. The
sizes are those of the mesh's first rank, whose blocks are the largest
(``torch.chunk`` gives the first chunks ``ceil(n / m)`` rows), so no rank holds
more. For a 1-D mesh this is ``(world + 1) * padded + full``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weight_transfer.layout.flat_blocks import is_flat, partition_numel
from weight_transfer.types import ParamMeta, dtype_size, numel

GATHER_MODES = ("param", "bucket")
DEFAULT_BUCKET_BYTES = 64 << 20
_ALIGN = 16
_GATHERABLE = ("shard", "replicate")


@dataclass(frozen=True, slots=True, kw_only=True)
class GatherBucket:
    """Consecutive parameters of one mesh gathered together (``coalesced``) or one alone."""

    params: tuple[ParamMeta, ...]
    coalesced: bool

    @property
    def key(self) -> str:
        """The label of the bucket's spans: the parameter's name, or the first and a count."""
        first = self.params[0].name
        return first if len(self.params) == 1 else f"{first} (+{len(self.params) - 1})"

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)


def coalescible(meta: ParamMeta) -> bool:
    """Whether one coalesced gather takes ``meta``: a tensor whose placements, one per
    mesh dim, are each ``shard`` or ``replicate``, at least one of them ``shard``; or a
    flat-partitioned one (ZeRO-3: :func:`weight_transfer.sender.flat_shard.gather_flat`)."""
    pl = meta.placements
    if is_flat(meta):
        return len(meta.shape) >= 1
    return (len(meta.shape) >= 1 and len(pl) == len(meta.mesh.shape)
            and all(p.kind in _GATHERABLE for p in pl) and any(p.kind == "shard" for p in pl))


def shard_levels(meta: ParamMeta) -> tuple[tuple[int, int, int], ...]:
    """``(mesh dim, its size, sharded tensor dim)`` of each sharded mesh dim, outermost first."""
    levels = []
    for k, p in enumerate(meta.placements):
        if p.kind != "shard":
            continue
        if not 0 <= p.dim < len(meta.shape):
            raise ValueError(f"parameter {meta.name!r}: placement {p} on mesh dim {k} shards "
                             f"tensor dim {p.dim}, but its shape {meta.shape} has "
                             f"{len(meta.shape)} dims")
        levels.append((k, meta.mesh.shape[k], p.dim))
    return tuple(levels)


def padded_blocks(meta: ParamMeta) -> list[int]:
    """Bytes of the padded block each sharded level sends, outermost first: the tensor
    chunked ``ceil(n / m)`` along the sharded dim at every level down to that one (flat:
    one level, ``ceil(numel / m)`` elements)."""
    if is_flat(meta):
        return [partition_numel(numel(meta.shape), len(meta.mesh.ranks))
                * dtype_size(meta.dtype)]
    shape = list(meta.shape)
    out = []
    for _, m, d in shard_levels(meta):
        shape[d] = -(-shape[d] // m)
        out.append(numel(tuple(shape)) * dtype_size(meta.dtype))
    return out


def plan_buckets(params: Sequence[ParamMeta], *, mode: str = "bucket",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[GatherBucket]:
    """Buckets in gather order (see the module docstring); ``mode="param"``: one per parameter."""
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, not {mode!r}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[GatherBucket] = []
    run: list[ParamMeta] = []
    totals: list[int] = []  # the run's summed _sizes, so a long run costs linear time

    def close() -> None:
        if run:
            out.append(GatherBucket(params=tuple(run), coalesced=True))
            run.clear()

    for meta in params:
        if mode == "param" or not coalescible(meta):
            close()
            out.append(GatherBucket(params=(meta,), coalesced=False))
            continue
        sizes = _sizes(meta)
        if run and (run[0].mesh != meta.mesh or run[0].placements != meta.placements
                    or _peak(meta, [a + b for a, b in zip(totals, sizes, strict=True)],
                             len(run) + 1) > bucket_bytes):
            close()
        totals = [a + b for a, b in zip(totals, sizes, strict=True)] if run else sizes
        run.append(meta)
    close()
    return out


def shard_rows(n: int, world: int, rank: int) -> int:
    """Rows (along the sharded dim) that ``rank`` holds when ``n`` rows are chunked over
    ``world`` ranks as ``torch.chunk`` does: the last ranks hold fewer or none."""
    chunk = -(-n // world)
    return max(0, min(chunk, n - rank * chunk))


def reserve_bytes(bucket: GatherBucket) -> int:
    """Peak temporary bytes of gathering ``bucket`` (without the prepared pieces)."""
    return _reserve(bucket.params, coalesced=bucket.coalesced)


def _reserve(params: Sequence[ParamMeta], *, coalesced: bool) -> int:
    if not coalesced:
        return sum(p.nbytes for p in params)
    totals = [sum(col) for col in zip(*(_sizes(p) for p in params), strict=True)]
    return _peak(params[0], totals, len(params))


def _sizes(meta: ParamMeta) -> list[int]:
    """The full tensor's bytes, then its padded block at each sharded level."""
    return [meta.nbytes, *padded_blocks(meta)]


def _peak(first: ParamMeta, totals: Sequence[int], count: int) -> int:
    """The largest over levels of ``(m_j + 1) * P_j + B_{j-1}`` (the module docstring),
    from the bucket's summed :func:`_sizes` and its ``count`` parameters (each aligned)."""
    sizes = ([len(first.mesh.ranks)] if is_flat(first)
             else [m for _, m, _ in shard_levels(first)])
    return max((m + 1) * (totals[j + 1] + count * _ALIGN) + totals[j]
               for j, m in enumerate(sizes))
