"""Model architectures by name: one module per family, found through one lazy registry.

Each module (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``,
``mixtral``) holds everything the project knows about its architecture as one
:class:`~weight_transfer.model.arch.base.Architecture` object: trainer parameters,
engine rule table, MoE layers, required config fields, the transformers config.
A second table maps a Hugging Face ``model_type`` (and its ``*ForCausalLM``
class) to a registered name, so a ``config.json`` picks its architecture
(``architecture_for_hf("kimi_k2") == "deepseek_v3"``; ``register_hf_model_type``
adds a row). The registry maps a name to ``(module, attribute)`` and imports the module on
first use (as vLLM's ``WeightTransferEngineFactory.register_engine`` does)::

    arch = get_architecture("mixtral")     # ValueError listing the known names
    arch.layer_rules(cfg, 0)

To add an architecture:

1. write ``weight_transfer/model/arch/<name>.py`` with a subclass of ``Architecture``
   (override only what differs from a Llama-style layer; shared tables and
   parameter lists are in :mod:`weight_transfer.model.arch.common`) and one instance;
2. register it: a line in ``_BUILTIN`` below, or ``register_architecture(name,
   module, attribute)`` from outside the package, and its Hugging Face
   ``model_type`` in ``_HF_BUILTIN`` (or ``register_hf_model_type``) so its
   ``config.json`` is read as it is;
3. add a tiny ``configs/models/tiny_<name>.yaml`` and tests: names and shapes
   against the transformers model, plans equal to ``weight_transfer.engines.reference.loader``, and
   generations equal to the transformers model (see tests/unit/test_mixtral.py).

Pure Python: neither this package nor its modules import torch or transformers.
"""

from __future__ import annotations

import importlib

from weight_transfer.model.arch.base import Architecture

__all__ = [
    "Architecture",
    "architecture_for_hf",
    "architecture_names",
    "get_architecture",
    "hf_model_types",
    "register_architecture",
    "register_hf_model_type",
]

_BUILTIN: dict[str, tuple[str, str]] = {
    "llama": ("weight_transfer.model.arch.llama", "LLAMA"),
    "qwen2": ("weight_transfer.model.arch.qwen2", "QWEN2"),
    "qwen3": ("weight_transfer.model.arch.qwen3", "QWEN3"),
    "qwen3_moe": ("weight_transfer.model.arch.qwen3_moe", "QWEN3_MOE"),
    "deepseek_v3": ("weight_transfer.model.arch.deepseek_v3", "DEEPSEEK_V3"),
    "mixtral": ("weight_transfer.model.arch.mixtral", "MIXTRAL"),
}
_REGISTRY: dict[str, tuple[str, str]] = dict(_BUILTIN)

# A Hugging Face config's ``model_type`` and its ``*ForCausalLM`` class -> the registered
# architecture that has the same tensor names and shapes (one table for both keys).
_HF_BUILTIN: tuple[tuple[str, str, str], ...] = (
    ("llama", "LlamaForCausalLM", "llama"),
    ("mistral", "MistralForCausalLM", "llama"),  # Llama's tensors; sliding window changes none
    ("qwen2", "Qwen2ForCausalLM", "qwen2"),
    ("qwen3", "Qwen3ForCausalLM", "qwen3"),
    ("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    ("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3"),
    ("kimi_k2", "DeepseekV3ForCausalLM", "deepseek_v3"),  # Kimi-K2's config.json
    ("mixtral", "MixtralForCausalLM", "mixtral"),
)
_HF_TABLE: list[tuple[str, str, str]] = list(_HF_BUILTIN)
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


def register_hf_model_type(model_type: str, hf_class: str, name: str) -> None:
    """Let a Hugging Face config of ``model_type`` (or ``architectures: [hf_class]``) pick
    the registered architecture ``name`` (registered before or after)."""
    _HF_TABLE.append((model_type, hf_class, name))


def architecture_for_hf(model_type: str | None, hf_classes: list[str] | tuple[str, ...] = ()
                        ) -> str | None:
    """The registered architecture of a Hugging Face ``model_type``, else of the first of
    ``hf_classes`` (a config's ``architectures``) the table knows; None if neither is known."""
    by_type = {t: n for t, _, n in _HF_TABLE}
    by_class = {c: n for _, c, n in _HF_TABLE}
    if model_type in by_type:
        return by_type[model_type]
    return next((by_class[c] for c in hf_classes if c in by_class), None)


def hf_model_types() -> tuple[str, ...]:
    """Every Hugging Face ``model_type`` the table maps, sorted."""
    return tuple(sorted({t for t, _, _ in _HF_TABLE}))


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
