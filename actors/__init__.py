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

Modules: trainer (TrainerMixin, TrainerActor), inference (InferenceMixin,
InferenceActor), schedule_actor (ScheduleActor), controller
(WeightTransferController), launch (placement and group formation), reports
(UpdateReport), config (TransferConfig), messages (what crosses Ray at setup),
handles (Launched: what a launch helper started, owned and closed by its caller).

The package imports its submodules lazily, on first access of a public name:
``import actors.reports`` (plain data) does not import Ray; ``from actors import
WeightTransferController`` does.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    "InferenceActor": "actors.inference",
    "InferenceMixin": "actors.inference",
    "InferenceWorker": "actors.inference",
    "Launched": "actors.handles",
    "PlanSummary": "actors.messages",
    "RankReport": "actors.reports",
    "ScheduleActor": "actors.schedule_actor",
    "Scheduler": "actors.schedule_actor",
    "TrainerActor": "actors.trainer",
    "TrainerMixin": "actors.trainer",
    "TrainerRankMeta": "actors.messages",
    "TrainerWorker": "actors.trainer",
    "TransferConfig": "actors.config",
    "UpdateError": "actors.controller",
    "UpdateReport": "actors.reports",
    "WeightTransferController": "actors.controller",
    "WriteFailure": "actors.reports",
    "launch_engines": "actors.launch",
    "launch_trainers": "actors.launch",
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
