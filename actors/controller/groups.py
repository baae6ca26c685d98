"""The peer copies of an update with replica groups (:mod:`actors.replica_groups`).

After the trainers' writes of an update, :func:`fill_followers` copies each group's
leader that got every byte into the group's other replicas (``wt_copy_to``, engine to
engine, all pairs at once, links connected on first use) and, where
``config.integrity`` is on, checks every filled region against the leader's; a
follower whose leader is torn, whose copy fails or whose check differs is torn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import ray

from actors.connections import copy_links
from actors.controller.calls import ControlCalls
from actors.controller.checks import verify_copy
from actors.controller.engine_control import RankFault
from actors.controller.state import ControllerState
from actors.replica_groups import ReplicaGroups
from weight_transfer.errors import FaultKind
from weight_transfer.types import EngineRankId

log = logging.getLogger(__name__)


def torn_leaders(state: ControllerState, faults: Mapping[str, Any], reports: Mapping[int, Any],
                 errors: Mapping[int, Any]) -> set[str]:
    """Replicas the trainers' writes of this update did not complete (as the update's check
    counts them): a rank fault, a failed trainer rank's replicas, a failed write."""
    names = list(state.replicas)
    torn = set(faults)
    for rank in errors:
        torn.update(state.summary.replicas_by_rank.get(rank, names))
    for rep in reports.values():
        torn.update(rep.failed_replicas)
    return torn


def fill_followers(state: ControllerState, calls: ControlCalls, *, groups: ReplicaGroups,
                   version: int, torn: set[str], until: float, integrity: bool
                   ) -> tuple[dict[str, list[RankFault]], dict[str, int]]:
    """Copy each leader that got every byte into its followers (all pairs at once); the
    faults of the followers not filled (their replicas torn) and the bytes copied into each
    follower. ``torn``: the leaders that did not get every byte."""
    pairs = groups.followers(state.replicas)
    faults: dict[str, list[RankFault]] = {}
    for follower, leader in pairs.items():
        if leader in torn:
            faults[follower] = [_fault(follower, r, f"its group's leader {leader} is torn")
                                for r in range(len(state.replicas[follower]))]
    todo = {f: lead for f, lead in pairs.items() if f not in faults and f not in torn}
    if not todo:
        return faults, {}
    links = [ln for f, lead in todo.items()
             for ln in copy_links(state.engine_metas[lead], state.engine_metas[f])
             if ln not in state.connector.links]
    try:
        if links:
            state.connector.connect(links, phase=f"connect group peers for version {version}")
    except (RuntimeError, TimeoutError, ValueError) as err:  # no copy: every follower torn
        for f in todo:
            faults[f] = [_fault(f, r, f"connecting to its leader {todo[f]}: {err}")
                         for r in range(len(state.replicas[f]))]
        return faults, {}
    refs, labels = [], []
    for f, lead in todo.items():
        for r, dst in enumerate(state.engine_metas[f]):
            refs.append(calls.call(state.replicas[lead][r].wt_copy_to, dst))
            labels.append((f, r, f"{EngineRankId(replica=lead, rank=r)} -> "
                                 f"{EngineRankId(replica=f, rank=r)}"))
    copied: dict[str, int] = {}
    for (f, r, label), (nbytes, why) in zip(labels, _answers(calls, refs, until), strict=True):
        if why:
            faults.setdefault(f, []).append(_fault(f, r, f"peer copy {label}: {why}"))
        else:
            copied[f] = copied.get(f, 0) + int(nbytes)
    if integrity:
        _check_copies(state, calls, todo, faults, until)
    log.info("version %d: followers %s filled from their group leaders (%d B); not filled: %s",
             version, sorted(set(copied) - set(faults)), sum(copied.values()), sorted(faults))
    return faults, {f: n for f, n in copied.items() if f not in faults}


def _fault(replica: str, rank: int, error: str) -> RankFault:
    return RankFault(replica=replica, rank=rank, kind=FaultKind.FAILED, method="wt_copy_to",
                     error=error)


def _answers(calls: ControlCalls, refs: list, until: float) -> list[tuple[int, str]]:
    """Each copy's byte count, or 0 and why it failed (an error, or no answer in time)."""
    _, late = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, until - time.monotonic()))
    out = []
    for ref in refs:
        if ref in late:
            out.append((0, "no answer before the update's deadline"))
            continue
        try:
            out.append((calls.ledger.get(ref), ""))
        except ray.exceptions.RayError as err:
            out.append((0, f"{type(err).__name__}: {str(err).splitlines()[0]}"))
    return out


def _check_copies(state: ControllerState, calls: ControlCalls, todo: Mapping[str, str],
                  faults: dict[str, list[RankFault]], until: float) -> None:
    """Every region of each filled follower hashes as its leader's (else it is torn)."""
    for f, lead in todo.items():
        if f in faults:
            continue
        check = verify_copy(source=state.replicas[lead], target=state.replicas[f],
                            source_metas=state.engine_metas[lead],
                            target_metas=state.engine_metas[f], call=calls.call,
                            get=calls.ledger.get, timeout_s=max(0.0, until - time.monotonic()))
        if not check.ok:
            faults[f] = [RankFault(replica=f, rank=0, kind=FaultKind.INTEGRITY,
                                   method="wt_copy_to", error=check.message())]
