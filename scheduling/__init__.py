"""Pure planning of weight transfers: no Ray, no torch.distributed.

``compute_plan`` maps trainer parameters onto engine tensors and assigns every
destination byte range to one source rank; ``simulate`` predicts how long the
plan takes on a cluster::

    from scheduling import compute_plan, load_cluster_config, simulate
    cluster = load_cluster_config("configs/clusters/local_cpu.yaml")
    plan = compute_plan(trainer_meta, engine_metas, cluster, model=cfg)
    plan.validate()
    result = simulate(plan, cluster)   # seconds, per-NIC busy time, lower bound

Modules: cluster (YAML configs), cluster_defaults (``simulated_cluster``: no file for a
CPU run; ``check_cluster`` against the actors), config_metadata (metas from a model config),
compute (``compute_plan``: match, then build), match (engine tensors -> pieces),
assign (pure balancing steps), build (tasks and their order), plan (the Plan's
data types), validate, tables (numpy columns for build and validate), serialize
(msgpack), simulate (discrete-event model).
"""

from scheduling.cluster.config import ClusterConfig, load_cluster_config
from scheduling.cluster.defaults import simulated_cluster
from scheduling.compute import compute_plan
from scheduling.plan import Plan
from scheduling.sim.simulate import SimResult, simulate
from weight_transfer.plan.types import TrainerGroup, TrainerPlan

__all__ = [
    "ClusterConfig",
    "Plan",
    "SimResult",
    "TrainerGroup",
    "TrainerPlan",
    "compute_plan",
    "load_cluster_config",
    "simulate",
    "simulated_cluster",
]
