"""Start the ready-made actors as the cluster config says: placement groups, gloo groups.

::

    cfg = TransferConfig.from_files(model_yaml, cluster_yaml)
    trainers = launch_trainers(cfg)             # FSDP2 model built, gloo group formed
    # (launch_trainers(cfg, demo=DemoActorConfig(seed=3, lr=1e-4)): the demo actors' own knobs)
    replicas = launch_engines(cfg)              # [[engine0/tp0, engine0/tp1], [...]]
    new = launch_engines(cfg, replicas=[2])     # one more replica, for add_replica
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ...
    new.close(); replicas.close(); trainers.close()    # or `with launch_engines(cfg) as ...`

Trainer ranks are packed per configured trainer node (one placement group per
node, one bundle per rank); each replica's TP ranks share one placement group.
Only (host, port) of each group's TCPStore crosses Ray. Both return a
:class:`~actors.ready.handles.Launched` that owns the actors and placement groups
it created (a sequence of the actors, or of the replicas' rank lists). The
engine launch of a run is found by its engine name:
:func:`actors.engine_registry.engine_spec`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import ray

from actors.config import DemoActorConfig, TransferConfig
from actors.controller.live_config import check_actors
from actors.placement import (
    ENGINE_NODE_RESOURCE,
    bundle_options,
    node_placement_groups,
)
from actors.ready.handles import Launched
from actors.ready.inference import InferenceActor
from actors.ready.trainer import TrainerActor

log = logging.getLogger(__name__)


def _form_group(actors: list[Any], *, what: str, timeout_s: float) -> list[str]:
    """Rank 0 hosts the store, every rank joins; returns each rank's node id."""
    host, port = ray.get(actors[0].host_store.remote(), timeout=timeout_s)
    refs = [a.init_rank.remote(host, port) for a in actors]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [i for i, r in enumerate(refs) if r in pending]
        raise TimeoutError(f"{what}: ranks {late} did not start within {timeout_s:g} s")
    return ray.get(refs)


def launch_trainers(config: TransferConfig, *, demo: DemoActorConfig = DemoActorConfig(),
                    actor_cls: Any = TrainerActor) -> Launched:
    """One trainer actor per rank, packed per node; gloo group and FSDP2 model ready
    (``demo``: the ready-made actors' seed, learning rate and CPUs). The handle owns the
    actors and placement groups (closed too when the start fails)."""
    t = config.require("launch_trainers").cluster.trainer
    groups = node_placement_groups(t.nodes, t.gpus_per_node, cpus=demo.actor_cpus,
                                   timeout_s=config.setup_timeout_s)
    handle = Launched([], groups=groups, what="trainers")
    with _closed_on_error(handle):
        handle.absorb(Launched([
            actor_cls.options(num_cpus=demo.actor_cpus,
                              **bundle_options(groups, rank=r, per_node=t.gpus_per_node))
            .remote(config, r, demo=demo)
            for r in range(config.cluster.trainer_world)
        ]))
        nodes = _form_group(list(handle), what="trainer group",
                            timeout_s=config.setup_timeout_s)
    log.info("%d trainer ranks on %d Ray nodes", len(handle), len(set(nodes)))
    return handle


def launch_engines(
    config: TransferConfig,
    *,
    replicas: Sequence[int] | None = None,
    demo: DemoActorConfig = DemoActorConfig(),
    actor_cls: Any = InferenceActor,
    trainers: Sequence[Any] | None = None,
) -> Launched:
    """Engine actors of ``replicas`` (default: every replica of the cluster config): a handle
    that is the list of replicas (each its TP ranks' actors) and owns them and their
    placement groups (one per replica; all closed when one replica fails to start).
    ``trainers``: the trainer actors, if started: their count is checked against the
    cluster before any engine starts."""
    check_actors(config.require("launch_engines").cluster, trainers=trainers)
    inf = config.cluster.inference
    replicas = list(range(inf.replicas)) if replicas is None else list(replicas)
    out = Launched([], what="engines")
    with _closed_on_error(out):
        for rep in replicas:  # every replica's actors start at once ...
            (pg,) = node_placement_groups(1, inf.gpus_per_replica, cpus=demo.actor_cpus,
                                          timeout_s=config.setup_timeout_s, first_node=rep,
                                          pin=ENGINE_NODE_RESOURCE)
            actors = [
                actor_cls.options(num_cpus=demo.actor_cpus,
                                  **bundle_options([pg], rank=local,
                                                   per_node=inf.gpus_per_replica))
                .remote(config, rep, local)
                for local in range(inf.gpus_per_replica)
            ]
            out.absorb(Launched([actors], groups=[pg]))
        # ... then each forms its group (the later replicas' processes started meanwhile)
        for rep, actors in zip(replicas, out, strict=True):
            _form_group(actors, what=f"replica {rep}", timeout_s=config.setup_timeout_s)
    return out


@contextlib.contextmanager
def _closed_on_error(handle: Launched) -> Iterator[None]:
    """Close what ``handle`` holds when the block raises (a launch that failed half-way)."""
    try:
        yield
    except BaseException:
        handle.close()
        raise
