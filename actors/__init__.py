"""Ray actors around the weight-transfer library: thin shells over scheduling/ and
weight_transfer/ (neither of which imports Ray).

::

    from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
    cfg = TransferConfig.from_files("configs/models/tiny_llama.yaml",
                                    "configs/clusters/local_cpu.yaml")
    ctl = WeightTransferController(trainers=launch_trainers(cfg), engines=launch_engines(cfg),
                                   config=cfg)
    ctl.setup()
    report = ctl.update(version=1)

Public names (this package's ``__all__``, listed in docs/embedding.md): the
controller and its config (``WeightTransferController``, ``TransferConfig``,
``TransferSettings``, ``UpdateReport``, ``UpdateError``), the two mixins for your
own actors (``TrainerMixin``, ``InferenceMixin``) and the ready-made actors with
their launch helpers and settings (``TrainerActor``, ``InferenceActor``,
``launch_trainers``, ``launch_engines``, ``DemoActorConfig``). Everything else
lives in its module: trainer, inference, schedule_actor, controller, launch,
reports, config, messages (what crosses Ray at setup).
``Launched`` (actors.ready.handles) is what a launch helper returns: it owns the actors,
engine owners and placement groups it started and closes them.

The package imports its submodules lazily, on first access of a public name:
``import actors.reports`` (plain data) does not import Ray; ``from actors import
WeightTransferController`` does.
"""

from __future__ import annotations

import importlib
from typing import Any

# The public API, exactly (docs/embedding.md lists the same names; a test compares them):
# public name -> the submodule that defines it. Internals (the ready-made workers' classes,
# the schedule actor, what crosses Ray at setup) are imported from their modules.
_EXPORTS: dict[str, str] = {
    "DemoActorConfig": "actors.config",
    "InferenceActor": "actors.inference",
    "InferenceMixin": "actors.inference",
    "Launched": "actors.ready.handles",
    "TrainerActor": "actors.trainer",
    "TrainerMixin": "actors.trainer",
    "TransferConfig": "actors.config",
    "TransferSettings": "actors.config",
    "UpdateError": "actors.controller.controller",
    "UpdateReport": "actors.reports",
    "WeightTransferController": "actors.controller.controller",
    "launch_engines": "actors.ready.launch",
    "launch_trainers": "actors.ready.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
