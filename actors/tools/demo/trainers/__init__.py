"""The demo's trainer actors by name: ``wt demo --trainer`` and ``wt bench designs --trainer``.

A run config's ``trainer`` (default ``fsdp2``) names the actor class that
:func:`actors.ready.launch.launch_trainers` starts, one per trainer rank, as
``"module:attribute"`` imported on first use (DeepSpeed is imported only by the run
that asks for it)::

    register_trainer("mine", "my_pkg.trainer:MyTrainerActor")
    trainer_actor("deepspeed")        # the Ray actor class, imported now

Every class takes ``(config, rank, demo=)``, forms its group in ``init_rank(host, port)``
and answers what the demo's checks ask of a trainer rank: ``train_step``,
``full_state_dict``, ``reference_generate`` and ``reference_logits`` (see
:class:`actors.ready.trainer.TrainerWorker`).
"""

from __future__ import annotations

import importlib
from typing import Any

DEFAULT_TRAINER = "fsdp2"
_TRAINERS: dict[str, str] = {}


def register_trainer(name: str, actor: str) -> None:
    """Name a trainer actor class (``"module:attribute"``); ValueError for another form."""
    if actor.count(":") != 1:
        raise ValueError(f"trainer {name!r}: {actor!r} must be 'module:attribute'")
    _TRAINERS[name] = actor


def trainer_names() -> list[str]:
    return sorted(_TRAINERS)


def check_trainer(name: str) -> str:
    """``name`` if registered; ValueError listing the registered trainers."""
    if name not in _TRAINERS:
        raise ValueError(f"unknown trainer {name!r} (choose from {', '.join(trainer_names())})")
    return name


def trainer_actor(name: str) -> Any:
    """The Ray actor class of trainer ``name``, imported now."""
    module, _, attr = _TRAINERS[check_trainer(name)].partition(":")
    return getattr(importlib.import_module(module), attr)


register_trainer("fsdp2", "actors.ready.trainer:TrainerActor")
register_trainer("deepspeed", "actors.tools.demo.trainers.deepspeed:DeepSpeedTrainerActor")
register_trainer("megatron", "actors.tools.demo.trainers.megatron:MegatronTrainerActor")
