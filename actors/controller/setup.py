"""Setup of :class:`~actors.controller.controller.WeightTransferController`: metadata, plan, NICs.

::

    summary = run_setup(state, calls, config)      # first setup, or again after a fault
    replan(state, calls, config)                   # after the replicas changed

:func:`run_setup` gathers every trainer's and engine's metadata and host (the
engines register their weight buffers with NICs of ``config.transport``),
refuses a transport that cannot reach a peer (naming the actors and hosts) and a
cluster that disagrees with the actors (trainer ranks, TP ranks of each replica),
reads the model from trainer 0's live model when ``config.model`` is None,
makes a new barrier store and barrier key (random name, secret; carried by Ray
only), then :func:`replan`: the schedule actor plans over
every replica, and every (trainer NIC, engine NIC) pair the plan writes through
exchanges endpoint information in both directions while each trainer gets its
blob (:mod:`actors.connections`). Again after a fault it gathers every engine's
metadata anew (:func:`refresh_engines`), keeps the replicas' versions and drops
replicas whose actors died.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from actors.config import TransferConfig
from actors.connections import plan_links
from actors.controller.calls import ControlCalls
from actors.controller.engine_control import dead_replicas, describe_faults, fan_out
from actors.controller.live_config import check_actors
from actors.controller.schedule_actor import ScheduleActor
from actors.controller.state import ControllerState
from actors.groups import node_ip
from actors.messages import PlanSummary, check_trainer_metas
from actors.placement import trainer_rank_infos
from actors.replica_groups import ReplicaGroups
from scheduling.cluster.defaults import check_cluster
from weight_transfer.engines.rank import EngineRank
from weight_transfer.engines.shadow.store import ShadowError, ShadowInfo
from weight_transfer.sync.barrier import BarrierKey
from weight_transfer.sync.store import BarrierStore
from weight_transfer.transport.handshake import Connection
from weight_transfer.types import EngineRankId, EngineRankMeta

log = logging.getLogger(__name__)


def run_setup(state: ControllerState, calls: ControlCalls, config: TransferConfig, *,
              engine_handles: Sequence[Any]) -> PlanSummary:
    """Gather metadata, plan, send every trainer its part, connect NICs (module docstring)."""
    again = state.summary is not None
    check_actors(config.cluster, trainers=state.trainers)  # setup(trainers=new) too
    metas = calls.gather([calls.call(t.wt_param_metas) for t in state.trainers],
                         [f"trainer {i}" for i in range(len(state.trainers))],
                         phase="gather trainer metadata")
    check_trainer_metas(metas)  # on receipt: ValueError naming the rank and field
    order = sorted(range(len(metas)), key=lambda i: metas[i].rank)
    state.trainers = [state.trainers[i] for i in order]
    state.trainer_metas = [metas[i] for i in order]
    state.connector.drop_trainers()  # new actors (or the same): connect them again
    for meta, actor in zip(state.trainer_metas, state.trainers, strict=True):
        state.connector.add_trainer(meta.rank, actor, meta.host)
    if again:
        refresh_engines(state, calls, config)
    else:
        if config.apply == "shadow":  # the shadow is what the NICs register, before the metas
            infos = setup_shadow(calls, list(engine_handles), config.transport_spec)
            state.shadow_bytes.update(shadow_bytes(infos))
        first_engines(state, engine_handles)
    check_cluster(config.cluster, replica_ranks={n: len(a) for n, a in state.replicas.items()})
    state.connector.check_engines([m.rank for m in state.trainer_metas], state.engine_list())
    state.rank_infos = trainer_rank_infos(config.cluster, [m.node for m in state.trainer_metas])
    # The trainers' barrier store, on the address other nodes reach this one by; a new
    # one for every setup (a failed update may have left a crossing's keys behind), with
    # a new random name and secret that only Ray carries (weight_transfer.sync.barrier).
    # Ours, in a process of its own: only holders of the secret get in, only the setup's
    # keys and small values are stored (weight_transfer.sync.store).
    if state.store is not None:
        state.store.close()
    state.barrier_key = BarrierKey.new()
    state.store_host = node_ip()
    state.store = BarrierStore(host=state.store_host, key=state.barrier_key,
                               timeout_s=config.setup_timeout_s)
    if state.scheduler is None:
        model = config.model or live_model_config(state, calls)
        state.scheduler = ScheduleActor.remote(model, config.cluster, fp8=config.engine_fp8,
                                               gather=config.gather)
    return replan(state, calls, config)


def live_model_config(state: ControllerState, calls: ControlCalls) -> Any:
    """The ModelConfig trainer rank 0's live model gives (``TransferConfig.model`` None)."""
    model = calls.gather([calls.call(state.trainers[0].wt_model_config)], ["trainer 0"],
                         phase="read the live model's config")[0]
    log.info("model from trainer 0's live model: %s (%s, %d layers)", model.name or "-",
             model.architecture, model.num_hidden_layers)
    return model


def first_engines(state: ControllerState, engine_handles: Sequence[Any]) -> None:
    metas = state.connector.gather_engines(list(engine_handles), label="engine actor",
                                           phase="gather engine metadata")
    for name, actors, ranks in group_replicas(list(engine_handles), metas):
        state.add_replica_entry(name, actors, ranks)
    state.versions = {name: None for name in state.replicas}


def refresh_engines(state: ControllerState, calls: ControlCalls,
                    config: TransferConfig) -> None:
    """Every replica's metadata again; a replica whose actor died is dropped, one that
    does not answer keeps its last metadata (it stays torn until it answers)."""
    until = time.monotonic() + config.update_timeout_s
    names = list(state.replicas)
    faults = fan_out(calls.ledger, state.replicas, names, EngineRank.wt_engine_meta,
                     config.transport_spec, until=until)
    for name in dead_replicas(faults):
        log.error("setup: replica %s dropped: %s", name, describe_faults(faults)[name])
        state.forget_replica(name)
    for name in [n for n in names if n in faults and n in state.replicas]:
        log.warning("setup: replica %s keeps its last metadata: %s", name,
                    describe_faults(faults)[name])
    fresh = [n for n in names if n not in faults]
    refs = [calls.call(a.wt_engine_meta, config.transport_spec)
            for n in fresh for a in state.replicas[n]]
    metas = iter(calls.gather(refs, [str(EngineRankId(replica=n, rank=r)) for n in fresh
                                     for r in range(len(state.replicas[n]))],
                              phase="gather engine metadata again"))
    for name in fresh:
        actors = state.replicas[name]
        ranks = [next(metas) for _ in actors]
        for meta in ranks:  # a rank set up again by another controller meanwhile
            state.connector.check_apply(meta, f"{name}/tp{meta.rank}")
        state.drop_replica_entry(name, keep_links=True)
        state.add_replica_entry(name, actors, ranks)


def group_replicas(actors: list, metas: list[EngineRankMeta]
                   ) -> Iterator[tuple[str, list[Any], list[EngineRankMeta]]]:
    """``(replica, its actors in rank order, their metadata)`` per replica the metas name."""
    groups: dict[str, dict[int, tuple[Any, EngineRankMeta]]] = {}
    for actor, meta in zip(actors, metas, strict=True):
        slot = groups.setdefault(meta.replica, {})
        if meta.rank in slot:
            raise ValueError(f"two engine actors claim {meta.id}")
        slot[meta.rank] = (actor, meta)
    for name, slot in groups.items():
        if sorted(slot) != list(range(len(slot))):
            raise ValueError(f"replica {name} has ranks {sorted(slot)}; expected 0..n-1")
        yield name, [slot[r][0] for r in sorted(slot)], [slot[r][1] for r in sorted(slot)]


def replan(state: ControllerState, calls: ControlCalls, config: TransferConfig) -> PlanSummary:
    """Plan over every replica the trainers write (all but the followers of
    ``config.replica_groups``, :mod:`actors.replica_groups`); connect the NIC pairs it
    writes through (both ways) while each trainer gets its blob."""
    groups = ReplicaGroups(groups=config.replica_groups)
    absent = sorted({n for g in groups.groups for n in g} - set(state.replicas))
    if absent:
        log.warning("replica_groups name replicas %s that this controller does not hold "
                    "(yet); replicas: %s", absent, sorted(state.replicas))
    planned = groups.planned(list(state.replicas))
    result = calls.gather(
        [calls.call(state.scheduler.plan, state.trainer_metas, state.rank_infos,
                    [m for n in planned for m in state.engine_metas[n]])],
        ["schedule actor"], phase="compute the plan")[0]
    store = (state.store_host, state.store.port)

    def trainer_call(rank: int, conns: tuple[Connection, ...]) -> Any:
        return calls.call(
            state.trainers[rank].wt_connect, result.blobs[rank], list(conns), store=store,
            barrier_key=state.barrier_key, rank_info=state.rank_infos[rank],
            options=config.rank_options())

    links = plan_links(state.rank_infos, result.summary.replicas_by_rank, state.engine_metas,
                       result.summary.regions_by_rank)
    state.connector.connect(links, phase="distribute the plan", rank_infos=state.rank_infos,
                            trainer_call=trainer_call)
    state.summary = dataclasses.replace(result.summary, shadow_bytes=dict(state.shadow_bytes))
    log.info("plan %d: %d B in %d tasks over %d trainer ranks -> replicas %s",
             state.summary.plan_id, state.summary.bytes_total, state.summary.num_tasks,
             len(state.trainers), list(state.replicas))
    return state.summary


log = logging.getLogger(__name__)


def engine_class(actor: Any) -> str:
    """The class an actor handle was made from, for messages."""
    desc = getattr(actor, "_ray_actor_creation_function_descriptor", None)
    return getattr(desc, "class_name", None) or type(actor).__name__


def setup_shadow(calls: ControlCalls, actors: Sequence[Any], transport: Any
                 ) -> list[ShadowInfo]:
    """Every engine rank allocates and registers its shadow (before its metadata is
    gathered); ShadowError naming the engine where one cannot."""
    for actor in actors:
        if getattr(actor, "wt_shadow_setup", None) is None:
            raise ShadowError(f"engine {engine_class(actor)} cannot run shadow mode (it does not "
                              "implement ShadowEngineRank: no second copy of its weights); "
                              "use TransferConfig.apply='in_place'")
    refs = [calls.call(a.wt_shadow_setup, transport) for a in actors]
    infos = calls.gather(refs, [f"engine actor {i}" for i in range(len(actors))],
                         phase="set up shadow copies")
    for info in infos:
        log.info("%s: shadow of %d B (+%d B scratch) on %s", info.owner, info.nbytes,
                 info.scratch_bytes, info.device)
    return infos


def shadow_bytes(infos: Sequence[ShadowInfo]) -> dict[str, int]:
    """Engine rank -> bytes shadow mode adds to it (the set-up report's numbers)."""
    return {info.owner: info.extra_bytes for info in infos}
