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

Public names: this package's ``__all__``, listed and documented in docs/embedding.md ("The
public API"); a test compares the two. Everything else is internal and imported from its
module. ``Launched`` (what a launch helper returns) owns the actors, engine owners and
placement groups it started and closes them.

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
    # the controller and its configuration
    "WeightTransferController": "actors.controller.controller",
    "TransferConfig": "actors.config",
    "TransferSettings": "actors.config",
    "UpdateReport": "actors.reports",
    "UpdateError": "actors.controller.controller",
    "WeightTransferError": "weight_transfer.errors",
    # your own actors
    "TrainerMixin": "actors.trainer",
    "InferenceMixin": "actors.inference",
    "EngineAdapter": "weight_transfer.engines.adapter",
    # the ready-made actors and their launch helpers
    "TrainerActor": "actors.ready.trainer",
    "InferenceActor": "actors.ready.inference",
    "launch_trainers": "actors.ready.launch",
    "launch_engines": "actors.ready.launch",
    "DemoActorConfig": "actors.config",
    "Launched": "actors.ready.handles",
    # vLLM: your own LLM or AsyncLLM actor, engines we launch, servers you run
    "VllmWeightsMixin": "actors.vllm.handle",
    "AsyncVllmWeightsMixin": "actors.vllm.handle",
    "vllm_replicas": "actors.vllm.handle",
    "launch_vllm_engines": "actors.vllm.engine",
    "save_trainer_checkpoint": "actors.vllm.engine",
    "connect_vllm_servers": "actors.vllm.served",
    "StreamingClient": "weight_transfer.engines.vllm.stream",
    "versions_seen": "weight_transfer.engines.vllm.stream",
    # another engine
    "register_engine": "actors.engine_registry",
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
