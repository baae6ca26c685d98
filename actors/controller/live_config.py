"""What the controller takes from the live actors: the cluster, the model, and the checks.

A user with their own actors writes neither a model file nor, for a CPU
(simulated) run, a cluster file::

    cfg = TransferConfig()                       # model and cluster None: both from the actors
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()                                  # trainer 0's live model gives the ModelConfig

* cluster None: :func:`cluster_for_actors` counts the actors the controller is
  given - trainer ranks, replicas (a list of lists: each replica's TP ranks) -
  and builds :func:`scheduling.cluster.defaults.simulated_cluster` (one
  simulated NIC per trainer rank and per engine rank);
* model None: at ``setup()`` trainer rank 0 answers ``wt_model_config()``
  (:meth:`actors.trainer.TrainerMixin.wt_model_config`: its live model's
  Hugging Face config and parameter dtype,
  :func:`~weight_transfer.model.models.model_config_from_hf`);
* a written cluster is checked against the actors (:func:`check_actors`) in the
  controller's constructor, in the launch helpers before any engine starts
  (``launch_vllm_engines(cfg, path, trainers=trainers)``), and at ``setup()``
  with the replicas as their engines report them; a mismatch names both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scheduling.cluster.config import ClusterConfig
from scheduling.cluster.defaults import check_cluster, simulated_cluster


def replica_sizes(engines: Sequence[Any]) -> dict[str, int] | None:
    """``{"#i": ranks}`` of engines given as a list of replicas (each a list of its TP
    ranks' actors); None for a flat list (each actor says its replica only when asked)."""
    if not engines or not all(isinstance(e, list | tuple | Sequence) and not isinstance(e, str)
                              for e in engines):
        return None
    return {f"#{i}": len(replica) for i, replica in enumerate(engines)}


def cluster_for_actors(trainers: Sequence[Any], engines: Sequence[Any], *,
                       fp8: bool = False) -> ClusterConfig:
    """A simulated cluster of these actors: ``len(trainers)`` trainer ranks, one replica per
    inner list of ``engines`` with that many TP ranks (ValueError for a flat list or
    replicas of different sizes)."""
    sizes = replica_sizes(engines)
    if sizes is None:
        raise ValueError("a cluster derived from the actors needs engines as a list of "
                         "replicas, each a list of its TP ranks' actors (or give "
                         "TransferConfig a cluster)")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"replicas of different TP sizes {sorted(sizes.values())}: give "
                         "TransferConfig a cluster")
    return simulated_cluster(trainer_ranks=len(trainers), replicas=len(sizes),
                             tensor_parallel=next(iter(sizes.values())), fp8=fp8)


def check_actors(cluster: ClusterConfig, *, trainers: Sequence[Any] | None = None,
                 engines: Sequence[Any] | None = None) -> None:
    """ClusterMismatchError naming both sides unless ``cluster`` says what the actors say
    (trainer count; replicas and their TP when ``engines`` is a list of replicas)."""
    sizes = replica_sizes(engines) if engines is not None else None
    check_cluster(cluster, trainer_ranks=None if trainers is None else len(trainers),
                  replicas=None if sizes is None else len(sizes), replica_ranks=sizes)


def with_cluster(config: Any, trainers: Sequence[Any], engines: Sequence[Any]) -> Any:
    """``config`` (a TransferConfig) with its cluster derived from the actors when None,
    else checked against them (:func:`check_actors`)."""
    if config.cluster is None:
        return config.replace(cluster=cluster_for_actors(trainers, engines,
                                                         fp8=bool(config.fp8)))
    check_actors(config.cluster, trainers=trainers, engines=engines)
    return config
