"""Fault injection for tests and ``wt chaos``: test-only subclasses of the ready-made actors.

The production actors carry no fault hooks. A test (or the chaos command)
that injects faults launches these classes instead::

    trainers = launch_trainers(cfg, actor_cls=FaultyTrainerActor)
    replicas = launch_engines(cfg, actor_cls=FaultyInferenceActor)
    ray.get(trainers[1].wt_set_link.remote(False))        # writes of rank 1 fail
    ray.get(replicas[0][0].wt_deregister.remote())        # its regions are revoked
    ray.get(replicas[0][1].wt_flip_byte.remote(name, 3))  # one corrupted byte
    ray.get(replicas[0][1].wt_drop_delta_header.remote(0))  # a delta slot header lost

Trainer hooks go through the transport's optional
:class:`~weight_transfer.transport.base.FaultInjection` interface (simnic only;
other transports refuse with a ``TypeError`` naming the transport). The mixins
also work on a plain :class:`~actors.trainer.TrainerMixin` /
:class:`~actors.inference.InferenceMixin` in a unit test, without Ray.

The trainer side is in :mod:`.trainer`, the engine side (reference engine and vLLM rank)
in :mod:`.engine`; both are importable from here. Each actor class's process imports
only its own side: an engine actor does not pay for the trainer's FSDP imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "TrainerFaultHooks": "trainer", "FaultyTrainerWorker": "trainer",
    "FaultyTrainerActor": "trainer",
    "EngineFaultHooks": "engine", "FaultyInferenceWorker": "engine",
    "FaultyInferenceActor": "engine", "FaultyVllmRank": "engine",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
