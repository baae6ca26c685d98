"""What ``full_tensor()`` costs per parameter: one ring all-gather per sharded mesh dim.

A parameter on a mesh of any rank count with placements ``(p_0, ..., p_{D-1})``
is gathered by DTensor one mesh dim at a time, innermost first (torch's
greedy redistribute walks the mesh dims from the last to the first); each
``Shard`` dim ``d`` of size ``n_d`` costs a ring all-gather over the ranks
that differ only in coordinate ``d`` (that dim's group), of the bytes the
tensor has once gathered along ``d``; ``Replicate`` dims cost nothing. So
FSDP ``(Shard(0),)`` on a 1-D mesh is one ring over every rank, HSDP
``(Replicate(), Shard(0))`` one ring over a replica group, EP x FSDP
``(Shard(0), Shard(1))`` a ring inside each EP group, then one across them::

    rings = gather_rings(mesh, placements, node_of)    # [(dim, n, one_node), ...]
    seconds, hops, held = param_gathers(plan, cluster)  # per parameter of the plan

A dim's link is ``intra_node_gbps`` (NVLink) when every group of that dim sits
inside one node, else the slower of that and ``inter_node_gbps`` (default: the
trainer NIC); with ``intra_node_gbps`` unset, gathers are free. ``hops`` is the
ring steps of one gather (sum of ``n_d - 1``): a coalesced bucket pays their
latency once for all its parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from weight_transfer.types import MeshDesc, Placement

# Placements a gather un-shards with one ring over the mesh dim (ZeRO-3's flat
# partitions gather like a Shard: each rank holds 1/n of the tensor).
_SHARDED = ("shard", "flat")

if TYPE_CHECKING:
    from scheduling.cluster.config import ClusterConfig
    from scheduling.plan import Plan


def ring_allgather_seconds(nbytes: np.ndarray, n: int, bytes_per_s: float,
                           latency_s: float) -> np.ndarray:
    """Ring all-gather of ``nbytes`` (the whole result) over ``n`` ranks."""
    if n <= 1:
        return np.zeros_like(nbytes, dtype=np.float64)
    return (n - 1) / n * nbytes / bytes_per_s + (n - 1) * latency_s


def sharded_fraction(mesh: MeshDesc, placements: tuple[Placement, ...]) -> float:
    """The fraction of the tensor one rank holds (1 / product of the Shard dims' sizes)."""
    n = 1
    for size, pl in zip(mesh.shape, placements, strict=False):
        if pl.kind in _SHARDED:
            n *= size
    return 1.0 / n


def gather_rings(mesh: MeshDesc, placements: tuple[Placement, ...],
                 node_of: dict[int, str]) -> list[tuple[int, int, bool]]:
    """``(mesh dim, group size, every group inside one node)`` per ring, in gather order."""
    if placements and len(placements) != len(mesh.shape):
        raise ValueError(f"{len(placements)} placements for a mesh of {len(mesh.shape)} "
                         f"dims {mesh.shape}")
    grid = np.asarray(mesh.ranks, dtype=np.int64).reshape(mesh.shape)
    rings = []
    for d in reversed(range(len(placements))):
        if placements[d].kind not in _SHARDED or mesh.shape[d] <= 1:
            continue
        groups = np.moveaxis(grid, d, -1).reshape(-1, mesh.shape[d])
        one_node = all(len({node_of[int(r)] for r in g}) == 1 for g in groups)
        rings.append((d, mesh.shape[d], one_node))
    return rings


def _coefficients(mesh: MeshDesc, placements: tuple[Placement, ...], node_of: dict[int, str],
                  cluster: ClusterConfig) -> tuple[float, int]:
    """(seconds per byte of the whole tensor, ring hops) of one gather on this layout."""
    sim = cluster.sim
    intra = np.inf if sim.intra_node_gbps is None else sim.intra_node_gbps * 1e9
    inter = sim.inter_node_gbps * 1e9 if sim.inter_node_gbps else cluster.send_bytes_per_s
    held = 1.0 / sharded_fraction(mesh, placements)  # shards still to gather, outer dims
    per_byte, hops = 0.0, 0
    for _, n, one_node in gather_rings(mesh, placements, node_of):
        held /= n  # after this ring the tensor is sharded only over the outer dims
        link = intra if one_node or sim.intra_node_gbps is None else min(intra, inter)
        per_byte += (n - 1) / n / held / link
        hops += n - 1
    return per_byte, hops


def param_gathers(plan: Plan, cluster: ClusterConfig) -> tuple[np.ndarray, ...]:
    """Per parameter of ``plan``: (gather seconds, ring hops, fraction a rank holds);
    no gathers (zeros) with ``sim.gathers`` off."""
    n = len(plan.params)
    node_of = {r.rank: r.node for r in plan.trainer_ranks}
    gathers = cluster.sim.gathers
    by_id: dict[tuple[int, int], tuple[float, int, float]] = {}  # metadata shares its meshes
    by_value: dict[tuple[MeshDesc, tuple[Placement, ...]], tuple[float, int, float]] = {}
    coef = np.zeros((n, 3))
    for i, p in enumerate(plan.params):
        key = (id(p.mesh), id(p.placements))
        if key not in by_id:
            value = (p.mesh, p.placements)
            if value not in by_value:
                try:
                    per_byte, hops = (_coefficients(p.mesh, p.placements, node_of, cluster)
                                      if gathers else (0.0, 0))
                except ValueError as err:
                    raise ValueError(f"parameter {p.name!r}: {err}") from None
                by_value[value] = (per_byte, hops, sharded_fraction(p.mesh, p.placements))
            by_id[key] = by_value[value]
        coef[i] = by_id[key]
    nbytes = np.fromiter((p.nbytes for p in plan.params), np.float64, n)
    hops = coef[:, 1].astype(np.int64)
    seconds = nbytes * coef[:, 0] + hops * (cluster.sim.gather_latency_us * 1e-6)
    return seconds, hops, coef[:, 2]
