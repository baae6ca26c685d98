"""Cluster descriptions nobody has to write, and a check of a written one against the actors.

A CPU (simulated) run needs no cluster YAML: the counts of what runs give one
simulated NIC per trainer rank and per engine rank, at memcpy speed unless
``nic_gbps`` caps them::

    cluster = simulated_cluster(trainer_ranks=2, replicas=1, tensor_parallel=2)

The controller does this itself from the actors it is given when
``TransferConfig.cluster`` is None (:func:`actors.controller.live_config.cluster_for_actors`).
A written cluster is compared with the actors before anything starts where the
counts are known (the launch helpers, the controller's constructor) and again at
``setup()``; a mismatch is a :class:`ClusterMismatchError` naming both sides::

    check_cluster(cluster, trainer_ranks=2)
    # ClusterMismatchError: cluster says 4 trainer ranks (configs/clusters/local_cpu.yaml:
    #   trainer.nodes 2 x gpus_per_node 2), 2 trainer actors were given

Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduling.cluster.config import ClusterConfig
from weight_transfer.errors import WeightTransferError

# The line rate written into a simulated cluster: only the simulator and the trace read
# it (a simnic moves bytes at memcpy speed unless TransferConfig.nic_gbps caps it).
SIMULATED_NIC_GBPS = 100.0


class ClusterMismatchError(WeightTransferError, ValueError):
    """The cluster description and the actors disagree; ``field`` is the cluster's field,
    ``expected`` its value and ``actual`` what the actors say."""

    def __init__(self, message: str, *, field: str = "", expected: Any = None,
                 actual: Any = None) -> None:
        super().__init__(message)
        self.field, self.expected, self.actual = field, expected, actual


def simulated_cluster(*, trainer_ranks: int, replicas: int, tensor_parallel: int,
                      trainer_nodes: int = 1, expert_parallel: int = 1, fp8: bool = False,
                      nic_gbps: float = SIMULATED_NIC_GBPS, name: str = "simulated"
                      ) -> ClusterConfig:
    """One simulated NIC per trainer rank (``trainer_nodes`` nodes) and per engine rank
    (``replicas`` engines of ``tensor_parallel`` ranks, one node each); ValueError for
    counts that do not fit."""
    if trainer_ranks < 1 or trainer_nodes < 1 or trainer_ranks % trainer_nodes:
        raise ValueError(f"simulated_cluster: {trainer_ranks} trainer ranks do not fill "
                         f"{trainer_nodes} nodes evenly")
    per_node = trainer_ranks // trainer_nodes
    return ClusterConfig(
        name=name,
        description=f"{trainer_ranks} trainer ranks -> {replicas} replicas x TP"
                    f"{tensor_parallel}, one simulated NIC per rank",
        trainer={"nodes": trainer_nodes, "gpus_per_node": per_node, "nics_per_node": per_node,
                 "nic_gbps": nic_gbps},
        inference={"replicas": replicas, "gpus_per_replica": tensor_parallel,
                   "tensor_parallel": tensor_parallel, "expert_parallel": expert_parallel,
                   "nics_per_node": tensor_parallel, "nic_gbps": nic_gbps, "fp8": fp8},
    )


def _where(cluster: ClusterConfig) -> str:
    return cluster.source or f"cluster {cluster.name!r}"


def check_cluster(cluster: ClusterConfig, *, trainer_ranks: int | None = None,
                  replicas: int | None = None,
                  replica_ranks: Mapping[str, int] | None = None) -> None:
    """ClusterMismatchError unless ``cluster`` says what the actors say: ``trainer_ranks``
    trainer actors, at most its ``replicas`` engine replicas (more are added later with
    ``with_replicas``), and ``replica_ranks`` (replica -> its TP ranks) equal to its TP."""
    where, t, inf = _where(cluster), cluster.trainer, cluster.inference
    if trainer_ranks is not None and trainer_ranks != cluster.trainer_world:
        raise ClusterMismatchError(
            f"cluster says {cluster.trainer_world} trainer ranks ({where}: trainer.nodes "
            f"{t.nodes} x gpus_per_node {t.gpus_per_node}), {trainer_ranks} trainer actors "
            "were given", field="trainer", expected=cluster.trainer_world, actual=trainer_ranks)
    if replicas is not None and replicas > inf.replicas:
        raise ClusterMismatchError(
            f"cluster says {inf.replicas} inference replicas ({where}: inference.replicas), "
            f"{replicas} were given", field="inference.replicas", expected=inf.replicas,
            actual=replicas)
    for name, ranks in (replica_ranks or {}).items():
        if ranks != inf.tensor_parallel:
            raise ClusterMismatchError(
                f"cluster says tensor_parallel {inf.tensor_parallel} ({where}: "
                f"inference.tensor_parallel), replica {name} has {ranks} ranks",
                field="inference.tensor_parallel", expected=inf.tensor_parallel, actual=ranks)
