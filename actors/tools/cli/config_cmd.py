"""``wt config check FILE [--kind model|cluster|run]``: validate a config file, show the result.

The kind is taken from ``--kind`` or from the content (a model config names an
``architecture``, or is a Hugging Face ``config.json`` with ``model_type``; a
cluster config has ``trainer`` and ``inference``; a run
config names a ``model`` file). The file goes through the same loader the
library uses (:mod:`weight_transfer.config_files`), so every error names the
file, the field and what was expected; the command exits 2 on an invalid file
and otherwise prints every field as resolved (defaults filled in, paths
resolved) and a few derived facts::

    wt config check configs/models/kimi_k2.yaml
    wt config check my_cluster.yaml --kind cluster
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic
from rich.table import Table

from actors.tools.cli.progress import command_console
from weight_transfer.config_files import read_yaml
from weight_transfer.model.hf_config import is_hf_config

KINDS = ("model", "cluster", "run")


def detect_kind(data: Any, path: Path) -> str:
    """The kind of a parsed config file, from its keys; ValueError naming the file if unclear."""
    if isinstance(data, dict):
        if "architecture" in data or is_hf_config(data):  # ours, or a config.json as it is
            return "model"
        if "trainer" in data or "inference" in data:
            return "cluster"
        if "model" in data:
            return "run"
    raise ValueError(f"{path}: cannot tell the kind of config: expected a mapping with "
                     "`architecture` (model), `trainer` and `inference` (cluster) or `model` "
                     "(run); pass --kind model|cluster|run")


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, bool]]:
    """(dotted field, value, set in the file) of a pydantic model, nested sections opened."""
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        key = f"{prefix}{name}"
        if isinstance(value, pydantic.BaseModel):
            yield from _flatten(value, key + ".")
        else:
            yield key, value, name in obj.model_fields_set


def _model_facts(cfg: Any) -> list[tuple[str, str]]:
    from weight_transfer.model.models import trainer_param_specs

    specs = trainer_param_specs(cfg)
    nbytes = sum(s.nbytes for s in specs)
    return [("trainer parameters", f"{len(specs):,}"),
            ("weights", f"{nbytes / 1e9:,.3f} GB ({cfg.torch_dtype})")]


def _cluster_facts(cfg: Any) -> list[tuple[str, str]]:
    return [("trainer ranks / NICs", f"{cfg.trainer_world} / {len(cfg.trainer_nics())}"),
            ("engine ranks / NICs", f"{cfg.engine_world} / {len(cfg.engine_nics())}"),
            ("send / receive bytes per s per NIC",
             f"{cfg.send_bytes_per_s / 1e9:g} GB/s / {cfg.recv_bytes_per_s / 1e9:g} GB/s")]


def _run_facts(cfg: Any) -> list[tuple[str, str]]:
    from scheduling.cluster.config import load_cluster_config
    from weight_transfer.model.models import load_model_config

    model = load_model_config(cfg.model_path)
    cluster = load_cluster_config(cfg.cluster_path)
    return [("model file", f"{cfg.model_path} ({model.name or model.architecture})"),
            ("cluster file", f"{cfg.cluster_path} ({cluster.name})")]


def _loaders() -> dict[str, tuple[Callable[[Path], Any], Callable[[Any], list]]]:
    from actors.tools.demo.run_config import load_run_config
    from scheduling.cluster.config import load_cluster_config
    from weight_transfer.model.models import load_model_config

    return {"model": (load_model_config, _model_facts),
            "cluster": (load_cluster_config, _cluster_facts),
            "run": (load_run_config, _run_facts)}


def check(path: Path, kind: str | None = None) -> tuple[str, Any, list[tuple[str, str]]]:
    """(kind, validated config, derived facts); ValueError names the file and the field."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    kind = kind or detect_kind(read_yaml(path, kind="config"), path)
    load, facts = _loaders()[kind]
    cfg = load(path)
    return kind, cfg, facts(cfg)


def render(path: Path, kind: str, cfg: Any, facts: list[tuple[str, str]]) -> Table:
    table = Table(title=f"{path}: a valid {kind} config", title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_column("from")
    for key, value, given in _flatten(cfg):
        table.add_row(key, repr(value) if isinstance(value, str) else str(value),
                      "file" if given else "[dim]default[/dim]")
    for key, value in facts:
        table.add_row(f"[cyan]{key}[/cyan]", value, "[cyan]derived[/cyan]")
    return table


def run_check(path: Path, *, kind: str | None) -> int:
    console = command_console()
    try:
        kind, cfg, facts = check(path, kind)
    except ValueError as err:
        console.print(f"[bold red]invalid:[/] {err}", markup=True, highlight=False)
        return 2
    console.print(render(path, kind, cfg, facts))
    return 0
