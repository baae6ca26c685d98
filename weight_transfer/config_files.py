"""One loader for every YAML configuration file: models, clusters and runs.

Each kind of file is a pydantic model; :func:`load_yaml` reads a file and
:func:`validate_mapping` checks an already parsed mapping, and both turn any
problem into one ``ValueError`` that names the file (or other source), the
kind of config, and every bad field::

    cfg = load_yaml(ModelConfig, "configs/models/tiny_llama.yaml", kind="model")
    # ValueError: configs/models/x.yaml: invalid model config: field hidden_size: ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

ConfigT = TypeVar("ConfigT", bound=pydantic.BaseModel)


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """``field a.b: message (got value); field c: message`` for every error of ``exc``."""
    return "; ".join(
        f"field {'.'.join(map(str, e['loc'])) or '<config>'}: {e['msg']}{_got(e)}"
        for e in exc.errors()
    )


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
