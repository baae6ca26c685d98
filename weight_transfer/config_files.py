"""One loader for every YAML configuration file: models, clusters and runs.

Each kind of file is a pydantic model; :func:`load_yaml` reads a file and
:func:`validate_mapping` checks an already parsed mapping, and both turn any
problem into one ``ValueError`` that names the file (or other source), the
kind of config, and every bad field::

    cfg = load_yaml(ModelConfig, "configs/models/tiny_llama.yaml", kind="model")
    # ValueError: configs/models/x.yaml: invalid model config: field hidden_size: ...

Every user-facing model derives from :class:`StrictModel` (frozen, unknown fields
refused), and every validation error is worded by :func:`format_validation_error`,
whatever says where it came from: ``field `` in a file's message, the class
(``TransferConfig.``) where code built it, ``TransferConfig.transport_options.``
for a transport's options. A validator that checks several fields of its model
raises :class:`FieldError`, whose message starts with the field it is about; the
formatter puts the model's location in front of it.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

# Set while a model validates: a model inside it (a section, a policy) lets its errors go up
# to the outermost one, which names the whole path (``transfer.retry.attempts``).
_VALIDATING: contextvars.ContextVar[bool] = contextvars.ContextVar("validating", default=False)


class StrictModel(pydantic.BaseModel):
    """The base of every configuration model: frozen (hashable, safe to share and to send
    between processes) and strict about names (an unknown field is an error, not ignored).

    Built in code (``TransferConfig(watermark_bytes=0)``), a bad value is one ``ValueError``
    naming the class and each field (``TransferConfig.watermark_bytes: Input should be
    greater than 0 (got 0)``); ``model_validate`` raises pydantic's ``ValidationError``, which
    :func:`validate_mapping` words for a file."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        if _VALIDATING.get():  # a part of a model being validated: the outer one reports
            super().__init__(**data)
            return
        token = _VALIDATING.set(True)
        try:
            super().__init__(**data)
        except pydantic.ValidationError as exc:
            prefix = f"{type(self).__name__}."
            raise ValueError(format_validation_error(exc, prefix=prefix)) from None
        finally:
            _VALIDATING.reset(token)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:
        token = _VALIDATING.set(True)
        try:
            return super().model_validate(obj, **kwargs)
        finally:
            _VALIDATING.reset(token)

    def replace(self, **changes: Any) -> Any:
        """A validated copy with ``changes`` applied (``model_copy`` would not check them)."""
        return type(self)(**{**{k: getattr(self, k) for k in type(self).model_fields},
                             **changes})


ConfigT = TypeVar("ConfigT", bound=pydantic.BaseModel)


class FieldError(ValueError):
    """A model validator's error about a field of its model: the message starts with that
    field (``nic_gbps caps simulated NICs only ...``), relative to the model, and
    :func:`format_validation_error` puts the model's location in front of it."""


def format_validation_error(exc: pydantic.ValidationError, *, prefix: str = "field ") -> str:
    """``{prefix}a.b: message (got value)`` for every error of ``exc``, joined by ``; ``.

    ``prefix`` says where the model sits: ``"field "`` in a file's message (the default),
    ``"TransferConfig."`` where code built it. A validator's own message comes as it is (no
    pydantic ``Value error,``); a :class:`FieldError` names its field itself."""
    return "; ".join(_format_one(e, prefix) for e in exc.errors())


def _format_one(error: Any, prefix: str) -> str:
    path = ".".join(map(str, error["loc"]))
    raised = error.get("ctx", {}).get("error") if error["type"] == "value_error" else None
    if isinstance(raised, FieldError):
        return f"{prefix}{path + '.' if path else ''}{raised}"
    text = str(raised) if raised is not None else error["msg"]
    return f"{prefix}{path or '<config>'}: {text}{_got(error)}"


def _got(error: Any) -> str:
    """`` (got 0)`` for a wrong scalar value; nothing for a missing field or a section."""
    value = error.get("input")
    if error.get("type") == "missing" or isinstance(value, dict | list | tuple):
        return ""
    text = repr(value)
    return f" (got {text if len(text) <= 40 else text[:37] + '...'})"


def validate_mapping(cls: type[ConfigT], data: Any, *, kind: str, source: str) -> ConfigT:
    """``cls`` validated from a parsed mapping; ValueError names ``source`` and each field."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a {kind} config must be a mapping, not {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ValueError(
            f"{source}: invalid {kind} config: {format_validation_error(exc)}"
        ) from None


def read_yaml(path: str | Path, *, kind: str) -> Any:
    """The parsed contents of a YAML file; ValueError if it cannot be read or parsed."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read {kind} config: {exc}") from None


def load_yaml(cls: type[ConfigT], path: str | Path, *, kind: str) -> ConfigT:
    """Read and validate one YAML config file of ``kind`` (``model``, ``cluster``, ``run``)."""
    return validate_mapping(cls, read_yaml(path, kind=kind), kind=kind, source=str(path))
