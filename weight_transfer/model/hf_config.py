"""A Hugging Face ``config.json`` read as it is: which keys are honoured, ignored or refused.

:class:`~weight_transfer.model.models.ModelConfig` accepts a ``config.json`` (a file, its
parsed mapping, or a transformers ``PretrainedConfig``) without editing::

    fields = fields_from_hf(json.load(f), known=ModelConfig.model_fields, source="config.json")

A mapping is read this way when it carries a Hugging Face marker (``model_type``,
``architectures`` or ``transformers_version``); our own model YAMLs have none and
stay strict (a typo is an error). For a Hugging Face mapping:

* ``architecture`` (ours) may be absent: ``model_type``, else ``architectures``,
  picks it through the table of :mod:`weight_transfer.model.arch`
  (``architecture_for_hf``); both given and disagreeing is refused;
* keys that are fields of ``ModelConfig`` are honoured, under the architecture's
  own spelling (``hf_key_aliases``: transformers 5's Qwen3-MoE says
  ``num_local_experts`` for ``num_experts``); ``dtype`` (transformers 5) or
  ``torch_dtype`` gives ``torch_dtype``; ``rope_parameters`` gives ``rope_theta``
  (and ``rope_scaling`` for a scaled RoPE); ``_name_or_path`` the ``name``;
* keys that would change tensor names or shapes and that no registered
  architecture expresses are refused by name, with their value and the source,
  unless they hold the value that changes nothing (:data:`TENSOR_KEYS`:
  ``mlp_bias: true``, a multimodal ``text_config``, a quantization other than
  FP8 in 128x128 blocks, a ``qk_head_dim`` other than nope + rope);
* every other key (``attention_dropout``, ``transformers_version``,
  ``layer_types``, token ids ...) changes no tensor: it is kept in ``hf_extra``
  and ignored.

Pure Python: no transformers import (a ``PretrainedConfig`` is read through its
``to_dict()``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from weight_transfer.errors import WeightTransferError
from weight_transfer.model.arch import architecture_for_hf, get_architecture, hf_model_types

HF_MARKERS = ("model_type", "architectures", "transformers_version")
_FP8_BLOCK = [128, 128]


class ConfigKeyError(WeightTransferError, ValueError):
    """A ``config.json`` key we cannot honour; ``key``, ``value`` and ``source`` name it."""

    def __init__(self, message: str, *, key: str = "", value: Any = None,
                 source: str = "") -> None:
        super().__init__(message)
        self.key, self.value, self.source = key, value, source


def _fp8_blocks(value: Any) -> bool:
    """FP8 in 128x128 blocks (DeepSeek-V3's checkpoint): the engines' own FP8 layout,
    chosen by the cluster's ``inference.fp8``; the trainer's tensors are not quantized."""
    if not isinstance(value, Mapping):
        return False
    block = value.get("weight_block_size")
    return value.get("quant_method") == "fp8" and (block is None or list(block) == _FP8_BLOCK)


def _is_false(value: Any) -> bool:
    return value in (None, False, 0)


# Keys that change tensor names or shapes and no registered architecture expresses:
# key -> (accepts(value), why). Values that change nothing are accepted.
TENSOR_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "mlp_bias": (_is_false, "biases on the MLP projections: no architecture lists them"),
    "shared_expert_intermediate_size": (_is_false, "a Qwen2-MoE shared expert"),
    "text_config": (_is_false, "a multimodal model: pass its text_config"),
    "vision_config": (_is_false, "a multimodal model: pass its text_config"),
    "quantization_config": (
        lambda v: v is None or _fp8_blocks(v),
        "only FP8 in 128x128 blocks (set by the cluster's inference.fp8) is supported"),
}


def is_hf_config(data: Any) -> bool:
    """Whether ``data`` is a Hugging Face config mapping (it carries a marker key)."""
    return isinstance(data, Mapping) and any(k in data for k in HF_MARKERS)


def _refuse(key: str, value: Any, why: str, source: str) -> ConfigKeyError:
    return ConfigKeyError(f"{source}: {key}: {value!r} changes tensors we cannot express "
                          f"({why})", key=key, value=value, source=source)


def _architecture(data: Mapping[str, Any], source: str) -> str:
    model_type, classes = data.get("model_type"), list(data.get("architectures") or ())
    found = architecture_for_hf(model_type, classes)
    given = data.get("architecture")
    if given is not None:
        if found is not None and found != given:
            raise ConfigKeyError(
                f"{source}: architecture {given!r} but model_type {model_type!r} "
                f"(architectures {classes}) is {found!r}", key="architecture", value=given,
                source=source)
        return given
    if found is None:
        raise ConfigKeyError(
            f"{source}: model_type {model_type!r} (architectures {classes}) maps to no "
            f"registered architecture; known model types: {', '.join(hf_model_types())} "
            "(or set architecture)", key="model_type", value=model_type, source=source)
    return found


def _check_tensor_keys(data: Mapping[str, Any], source: str) -> None:
    for key, (accepts, why) in TENSOR_KEYS.items():
        if key in data and not accepts(data[key]):
            raise _refuse(key, data[key], why, source)
    qk = data.get("qk_head_dim")
    parts = (data.get("qk_nope_head_dim") or 0) + (data.get("qk_rope_head_dim") or 0)
    if qk is not None and qk != parts:
        raise _refuse("qk_head_dim", qk, f"not qk_nope_head_dim + qk_rope_head_dim = {parts}",
                      source)


def _rope(rope: Any) -> dict[str, Any]:
    """``rope_theta`` (and ``rope_scaling`` unless default) from transformers 5's
    ``rope_parameters``."""
    if not isinstance(rope, Mapping):
        return {}
    out: dict[str, Any] = {}
    if rope.get("rope_theta") is not None:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type") not in (None, "default"):
        out["rope_scaling"] = dict(rope)
    return out


def _plain(value: Any) -> Any:
    """``value`` as JSON data (kept in ``hf_extra``: hashable, picklable, printable)."""
    return json.loads(json.dumps(value, default=str))


def fields_from_hf(data: Mapping[str, Any], *, known: Iterable[str],
                   source: str = "<config>") -> dict[str, Any]:
    """The ``ModelConfig`` fields of a Hugging Face config mapping (module docstring);
    ``known`` are ModelConfig's field names. ConfigKeyError names a refused key."""
    known = set(known)
    arch = _architecture(data, source)
    _check_tensor_keys(data, source)
    aliases = dict(get_architecture(arch).hf_key_aliases)
    out: dict[str, Any] = {"architecture": arch}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        field = aliases.get(key, key)
        if key == "architecture" or value is None:
            continue
        if field in known and field not in out:
            out[field] = value
        elif key not in aliases:
            extra[key] = value
    dtype = data.get("torch_dtype") or data.get("dtype")  # an override says torch_dtype
    if dtype is not None:
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
    for key, value in _rope(data.get("rope_parameters")).items():
        out.setdefault(key, value)
    if not out.get("name") and data.get("_name_or_path"):
        out["name"] = str(data["_name_or_path"])
    if "hf_extra" in known:
        out["hf_extra"] = _plain({**extra, **out.get("hf_extra", {})})
    return out
