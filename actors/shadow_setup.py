"""Shadow mode at set-up: every engine rank allocates and registers its second copy.

Called by :func:`actors.controller_setup.run_setup` (and ``add_replica``) before the
engines' metadata is gathered, so the regions the plan targets are the shadows::

    infos = setup_shadow(calls, engine_actors, config.transport_spec)
    shadow_bytes(infos)      # {"engine0/tp0": bytes shadow mode adds to that rank, ...}

An engine whose actor does not implement
:class:`~weight_transfer.engines.rank.ShadowEngineRank` is refused here with a
``ShadowError`` naming the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from actors.controller_calls import ControlCalls
from weight_transfer.engines.shadow import ShadowError, ShadowInfo

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
