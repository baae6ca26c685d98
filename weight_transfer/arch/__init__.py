"""Model architectures by name: one module per family, found through one lazy registry.

Each module (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``,
``mixtral``) holds everything the project knows about its architecture as one
:class:`~weight_transfer.arch.base.Architecture` object: trainer parameters,
engine rule table, MoE layers, required config fields, the transformers config.
The registry maps a name to ``(module, attribute)`` and imports the module on
first use (as vLLM's ``WeightTransferEngineFactory.register_engine`` does)::

    arch = get_architecture("mixtral")     # ValueError listing the known names
    arch.layer_rules(cfg, 0)

To add an architecture:

1. write ``weight_transfer/arch/<name>.py`` with a subclass of ``Architecture``
   (override only what differs from a Llama-style layer; shared tables and
   parameter lists are in :mod:`weight_transfer.arch.common`) and one instance;
2. register it: a line in ``_BUILTIN`` below, or ``register_architecture(name,
   module, attribute)`` from outside the package;
3. add a tiny ``configs/models/tiny_<name>.yaml`` and tests: names and shapes
   against the transformers model, plans equal to ``weight_transfer.engines.reference.loader``, and
   generations equal to the transformers model (see tests/unit/test_mixtral.py).

Pure Python: neither this package nor its modules import torch or transformers.
"""

from __future__ import annotations

import importlib

from weight_transfer.arch.base import Architecture

__all__ = ["Architecture", "architecture_names", "get_architecture", "register_architecture"]

_BUILTIN: dict[str, tuple[str, str]] = {
    "llama": ("weight_transfer.arch.llama", "LLAMA"),
    "qwen2": ("weight_transfer.arch.qwen2", "QWEN2"),
    "qwen3": ("weight_transfer.arch.qwen3", "QWEN3"),
    "qwen3_moe": ("weight_transfer.arch.qwen3_moe", "QWEN3_MOE"),
    "deepseek_v3": ("weight_transfer.arch.deepseek_v3", "DEEPSEEK_V3"),
    "mixtral": ("weight_transfer.arch.mixtral", "MIXTRAL"),
}
_REGISTRY: dict[str, tuple[str, str]] = dict(_BUILTIN)
_LOADED: dict[str, Architecture] = {}


def register_architecture(name: str, module: str, attribute: str) -> None:
    """Make ``getattr(import_module(module), attribute)`` the architecture ``name``.

    The module is imported on the first :func:`get_architecture` of ``name``.
    Registering a name twice is a ValueError unless it names the same object.
    """
    if _REGISTRY.get(name, (module, attribute)) != (module, attribute):
        raise ValueError(
            f"architecture {name!r} is already registered as {_REGISTRY[name][0]}."
            f"{_REGISTRY[name][1]}"
        )
    _REGISTRY[name] = (module, attribute)


def architecture_names() -> tuple[str, ...]:
    """Every registered name, sorted."""
    return tuple(sorted(_REGISTRY))


def get_architecture(name: str) -> Architecture:
    """The architecture registered as ``name``; ValueError listing the known names."""
    arch = _LOADED.get(name)
    if arch is not None:
        return arch
    try:
        module, attribute = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown architecture {name!r}; known: {', '.join(architecture_names())}"
        ) from None
    arch = getattr(importlib.import_module(module), attribute, None)
    if not isinstance(arch, Architecture):
        raise ValueError(
            f"architecture {name!r}: {module}.{attribute} is not an Architecture "
            f"but {type(arch).__name__}"
        )
    _LOADED[name] = arch
    return arch
