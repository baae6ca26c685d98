"""Gather buckets from metadata alone: which parameters one collective gathers together.

The pure half of :mod:`weight_transfer.gather` (no torch), shared by the
executor, which gathers each bucket in one collective, and the simulator
(:mod:`scheduling.sim_stages`), which replays the same buckets as pipeline
items::

    buckets = plan_buckets(group_params, mode="bucket", bucket_bytes=64 << 20)
    [b.key for b in buckets], [reserve_bytes(b) for b in buckets]

A bucket is a run of consecutive parameters (in the plan's gather order) on one
1-D mesh with placements ``(Shard(0),)`` (FSDP2's) whose gather holds at most
``bucket_bytes`` of temporary memory; any other parameter is a bucket of its
own (``full_tensor()``). Every rank of a mesh cuts the same buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weight_transfer.types import ParamMeta, Placement

GATHER_MODES = ("param", "bucket")
DEFAULT_BUCKET_BYTES = 64 << 20
_SHARD0 = (Placement(kind="shard", dim=0),)
_ALIGN = 16


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
    """Whether the metadata says FSDP2's layout: ``Shard(0)`` on a 1-D mesh of a tensor."""
    return len(meta.mesh.shape) == 1 and meta.placements == _SHARD0 and len(meta.shape) >= 1


def plan_buckets(params: Sequence[ParamMeta], *, mode: str = "bucket",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[GatherBucket]:
    """Buckets in gather order (see the module docstring); ``mode="param"``: one per parameter."""
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, not {mode!r}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[GatherBucket] = []
    run: list[ParamMeta] = []

    def close() -> None:
        if run:
            out.append(GatherBucket(params=tuple(run), coalesced=True))
            run.clear()

    for meta in params:
        if mode == "param" or not coalescible(meta):
            close()
            out.append(GatherBucket(params=(meta,), coalesced=False))
            continue
        if run and (run[0].mesh != meta.mesh
                    or _reserve([*run, meta], coalesced=True) > bucket_bytes):
            close()
        run.append(meta)
    close()
    return out


def shard_rows(n: int, world: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` holds when ``n`` rows are chunked over ``world`` ranks."""
    chunk = -(-n // world)
    return max(0, min(chunk, n - rank * chunk))


def _padded_bytes(meta: ParamMeta, world: int) -> int:
    rows = meta.shape[0]
    return -(-rows // world) * (meta.nbytes // rows) if rows else 0


def reserve_bytes(bucket: GatherBucket) -> int:
    """Peak temporary bytes of gathering ``bucket`` (without the prepared pieces)."""
    return _reserve(bucket.params, coalesced=bucket.coalesced)


def _reserve(params: Sequence[ParamMeta], *, coalesced: bool) -> int:
    full = sum(p.nbytes for p in params)
    if not coalesced:
        return full
    world = params[0].mesh.shape[0]
    padded = sum(_padded_bytes(m, world) + _ALIGN for m in params)
    return padded * (world + 1) + full
