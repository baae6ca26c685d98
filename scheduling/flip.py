"""Shadow mode on paper: the bytes of one more copy per engine rank, whether they fit, and
the flip's stall.

Shadow mode (``TransferConfig.apply="shadow"``, :mod:`weight_transfer.engines.shadow.store`)
keeps a second copy of every tensor an engine rank computes with; a flip swaps the
two copies in device memory. From the model and the cluster alone::

    need = shadow_need(model, cluster, fp8=True)      # ShadowNeed: bytes per rank ...
    need.fits, need.message()                          # against inference.memory_gib
    flip_seconds(need.rank_bytes, cluster.inference.device_copy_gbps)
    sync_seconds(need.rank_bytes, cluster.inference.device_copy_gbps)  # delta: live->shadow

A swap moves every byte of both copies in and out of memory once (through one
chunk of scratch that stays in cache): twice the traffic of a copy, so the stall
of a flip is ``2 * rank_bytes / copy rate``, where a device-to-device copy rate
is about half the memory bandwidth (it reads and writes). The ranks of a replica
flip in parallel; the replica's stall is its largest rank's. With sparse deltas
each delta update first copies live into the shadow (:func:`sync_seconds`, one
copy: half a swap's traffic) while the engine serves: memory bandwidth taken
from generation, not a pause. Nothing here needs torch or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.cluster.config import ClusterConfig
from weight_transfer.layout.engine_layout import engine_tensor_specs
from weight_transfer.model.models import ModelConfig

GIB = 1 << 30
FLIP_SCRATCH_BYTES = 8 << 20  # weight_transfer.engines.shadow.store.FLIP_CHUNK_BYTES


def rank_weight_bytes(model: ModelConfig, cluster: ClusterConfig, *, fp8: bool) -> list[int]:
    """Bytes of the tensors each rank of one replica computes with (rank order)."""
    n = cluster.inference.gpus_per_replica
    return [sum(s.nbytes for s in engine_tensor_specs(model, cluster.engine_rank(0, r)[2],
                                                       fp8=fp8)) for r in range(n)]


def flip_seconds(rank_bytes: int, copy_gbps: float | None) -> float | None:
    """The stall of one flip (a swap) of ``rank_bytes``, at a device copy rate of
    ``copy_gbps`` GB/s; None where the rate is not given."""
    if copy_gbps is None:
        return None
    return 2.0 * rank_bytes / (copy_gbps * 1e9)


def sync_seconds(rank_bytes: int, copy_gbps: float | None) -> float | None:
    """A delta update's copy of live into the shadow (``rank_bytes`` copied once at
    ``copy_gbps`` GB/s, while the engine serves); None where the rate is not given."""
    if copy_gbps is None:
        return None
    return rank_bytes / (copy_gbps * 1e9)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShadowNeed:
    """One more copy per engine rank against the device memory the cluster states."""

    cluster: str
    rank_bytes: int  # the largest rank's weights: the shadow's size
    extra_bytes: int  # what shadow mode adds to that rank (shadow + flip scratch)
    memory_gib: float | None  # device memory of one engine GPU (None: not stated)
    reserved_gib: float

    @property
    def needed_gib(self) -> float:
        return (self.rank_bytes + self.extra_bytes) / GIB + self.reserved_gib

    @property
    def fits(self) -> bool:
        return self.memory_gib is None or self.needed_gib <= self.memory_gib

    def message(self) -> str:
        where = f"cluster {self.cluster!r}"
        if self.memory_gib is None:
            return (f"{where}: shadow mode adds {self.extra_bytes / GIB:.2f} GiB per engine rank "
                    "(inference.memory_gib not stated: not checked)")
        verdict = "fits" if self.fits else "does not fit"
        return (f"{where}: shadow mode {verdict}: an engine rank needs "
                f"{self.rank_bytes / GIB:.2f} GiB of weights + {self.extra_bytes / GIB:.2f} GiB "
                f"shadow + {self.reserved_gib:.2f} GiB reserved = {self.needed_gib:.2f} GiB, "
                f"the GPU has {self.memory_gib:.2f} GiB (inference.memory_gib)")


def shadow_need(model: ModelConfig, cluster: ClusterConfig, *, fp8: bool) -> ShadowNeed:
    rank_bytes = max(rank_weight_bytes(model, cluster, fp8=fp8))
    inf = cluster.inference
    return ShadowNeed(cluster=cluster.name, rank_bytes=rank_bytes,
                      extra_bytes=rank_bytes + min(FLIP_SCRATCH_BYTES, rank_bytes),
                      memory_gib=inf.memory_gib, reserved_gib=inf.reserved_gib)
