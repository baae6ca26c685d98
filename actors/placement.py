"""Where actors run: placement groups per cluster node, and node-aware NIC names.

The cluster config says how many trainer ranks share a node. One placement
group per configured node packs its ranks together (one bundle per rank):
``STRICT_PACK`` when the Ray cluster has several nodes, ``PACK`` on one. When
Ray nodes carry a custom resource ``node_<k>`` (``ray start --resources``, or
``Cluster.add_node(resources=...)`` in tests), configured node ``k`` is pinned
to the Ray node that has it::

    pgs = node_placement_groups(cfg.cluster.trainer.nodes, cfg.cluster.trainer.gpus_per_node,
                                cpus=0.1)
    opts = bundle_options(pgs, rank=3, per_node=2)  # -> .options(**opts)

After the actors start, each reports the Ray node it runs on, and
:func:`trainer_rank_infos` makes that Ray node id the rank's ``RankInfo.node``
and names its NIC after the node it really runs on (``tnode<i>/nic<j>``):
ranks on different Ray nodes never share a NIC, whatever the config assumed,
so the plan balances bytes over NICs that exist where the ranks are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from scheduling.cluster.config import ClusterConfig
from weight_transfer.types import NicId, RankInfo

log = logging.getLogger(__name__)

NODE_RESOURCE = "node_{}"  # trainer node k
ENGINE_NODE_RESOURCE = "inode_{}"  # inference replica k
_PIN_AMOUNT = 0.001


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def node_placement_groups(
    nodes: int,
    per_node: int,
    *,
    cpus: float,
    timeout_s: float = 120.0,
    first_node: int = 0,
    pin: str = NODE_RESOURCE,
) -> list[PlacementGroup]:
    """One ready placement group per configured node, ``per_node`` bundles of ``cpus`` each.

    Configured node ``k`` (from ``first_node``) is pinned to the Ray node with
    resource ``pin.format(k)`` when such a node exists.
    """
    alive = _alive_nodes()
    multi = len(alive) > 1
    resources = {r for n in alive for r in n.get("Resources", {})}
    groups = []
    for k in range(first_node, first_node + nodes):
        bundle = {"CPU": cpus}
        if pin.format(k) in resources:
            bundle[pin.format(k)] = _PIN_AMOUNT
        pg = placement_group([dict(bundle) for _ in range(per_node)],
                             strategy="STRICT_PACK" if multi else "PACK", name="")
        groups.append(pg)
    ready = [pg.ready() for pg in groups]
    _, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
    if pending:
        missing = [i + first_node for i, ref in enumerate(ready) if ref in pending]
        raise TimeoutError(
            f"placement groups of configured nodes {missing} were not placed within "
            f"{timeout_s:g} s ({per_node} bundles of {cpus} CPU each); does the Ray "
            f"cluster have the resources? available: {ray.available_resources()}"
        )
    return groups


def bundle_options(groups: Sequence[PlacementGroup], *, rank: int, per_node: int) -> dict:
    """``.options(**...)`` that puts local rank ``rank`` into its node's bundle."""
    node, local = divmod(rank, per_node)
    if not 0 <= node < len(groups):
        raise ValueError(f"rank {rank} needs node {node}; only {len(groups)} placement groups")
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=groups[node], placement_group_bundle_index=local
    )
    return {"scheduling_strategy": strategy}


def remove_groups(groups: Sequence[PlacementGroup]) -> None:
    """Remove placement groups (their launch handle's close; best effort: one that Ray has
    already dropped, or a Ray that has shut down, is logged and skipped)."""
    for pg in groups:
        try:
            ray.util.remove_placement_group(pg)
        except Exception as exc:
            log.warning("placement group %s not removed: %s", pg.id.hex(), exc)


def trainer_rank_infos(cluster: ClusterConfig, node_ids: Sequence[str]) -> tuple[RankInfo, ...]:
    """RankInfo per trainer rank from the Ray node each rank really runs on.

    ``node`` is the Ray node id. A simulated node is a (Ray node, configured
    node) pair: configured nodes placed on one host (local development) stay
    distinct, and ranks on different Ray nodes never share a NIC. Simulated
    nodes are labelled ``tnode<i>`` in order of their lowest rank; the ``j``-th
    rank on one (by rank order) sends through the NIC the cluster config gives
    local GPU ``j``.
    """
    t = cluster.trainer
    if len(node_ids) != cluster.trainer_world:
        raise ValueError(
            f"cluster {cluster.name!r} has {cluster.trainer_world} trainer ranks, "
            f"got node ids of {len(node_ids)}"
        )
    labels: dict[tuple[str, int], str] = {}
    seen: dict[tuple[str, int], int] = {}
    out = []
    for rank, node in enumerate(node_ids):
        if not node:
            raise ValueError(f"trainer rank {rank} reported an empty node id")
        key = (node, rank // t.gpus_per_node)
        label = labels.setdefault(key, f"tnode{len(labels)}")
        local = seen.get(key, 0)
        seen[key] = local + 1
        nic_index = cluster.trainer_nic_index(local) % t.nics_per_node
        out.append(RankInfo(rank=rank, node=node, nic=str(NicId(node=label, index=nic_index))))
    hosts = len(set(node_ids))
    if hosts not in (1, t.nodes):
        log.warning("cluster %s configures %d trainer nodes; the ranks run on %d Ray nodes",
                    cluster.name, t.nodes, hosts)
    return tuple(out)
