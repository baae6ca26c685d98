"""The trainer sources by name, imported on first use, and which one a model is.

A source (:class:`TrainerSource`) gives the transfer what it needs of one trainer
rank's live model: its parameters' metadata (``param_metas``: name, global shape,
dtype, mesh, placements), what the executor reads each parameter from at an update
(``tensors``: a DTensor, a plain tensor, a ZeRO-3 flat partition, a Megatron TP
block), the model whose Hugging Face ``.config`` describes the architecture
(``module``) and the full weights (``full_state``, a collective, for checkpoints)::

    source = open_source(engine_or_model, rank=r, world=n)          # recognised
    source = open_source(model, rank=r, world=n, source="deepspeed")  # or named
    source = open_source(gpt_model, rank=r, world=n)                # Megatron-core
    source.check()                                  # ValueError naming parameter and rank

Without a name the first source whose ``recognizes(model)`` holds is taken, in
:data:`DETECT_ORDER` (``fsdp2`` takes any module: plain tensors are replicated).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

from weight_transfer.types import ParamMeta

__all__ = ["DETECT_ORDER", "SOURCES", "TrainerSource", "open_source", "source_class"]

# name -> (module, class); imported when a model is attached
SOURCES: Mapping[str, tuple[str, str]] = {
    "deepspeed": ("weight_transfer.sources.deepspeed", "DeepSpeedSource"),
    "fsdp2": ("weight_transfer.sources.fsdp", "Fsdp2Source"),
    "megatron": ("weight_transfer.sources.megatron", "MegatronSource"),
}
DETECT_ORDER = ("deepspeed", "megatron", "fsdp2")


class TrainerSource(Protocol):
    """One trainer rank's model as the transfer reads it (see the module docstring)."""

    name: str
    module: Any  # torch.nn.Module: its .config describes the model (wt_model_config)

    def check(self) -> None: ...

    def param_metas(self) -> list[ParamMeta]: ...

    def tensors(self) -> dict[str, Any]: ...

    def full_state(self) -> dict[str, Any]: ...


def source_class(name: str) -> Any:
    """The class of source ``name``; ValueError naming the known ones."""
    try:
        module, cls = SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown trainer source {name!r}; known: {sorted(SOURCES)}") from None
    return getattr(importlib.import_module(module), cls)


def open_source(model: Any, *, rank: int, world: int, source: str | None = None
                ) -> TrainerSource:
    """The source of ``model`` on trainer ``rank`` of ``world`` (named, or recognised)."""
    if source is None:
        source = next((n for n in DETECT_ORDER if source_class(n).recognizes(model)), None)
        if source is None:
            raise ValueError(f"trainer rank {rank}: no trainer source recognises a "
                             f"{type(model).__name__}; known: {sorted(SOURCES)}")
    return source_class(source)(model, rank=rank, world=world)
