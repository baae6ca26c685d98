"""The engine registry: an inference engine's name, resolved once, to what launches it.

It lives in ``actors`` because everything it names does: the launch functions that start
engine-rank actors and the command line's hooks. The core (``weight_transfer.engines``)
holds the engine-rank contract and its shared implementation, and names no engine.

Every place that needs an engine by name (a run config's ``engine``, ``wt demo
--engine``, ``wt bench designs``, the RL loop) asks :func:`engine_spec`; nothing
else compares engine names. A spec names modules and attributes as strings and
imports them on first use, so this module imports no engine or Ray::

    spec = engine_spec("vllm")               # ValueError listing the names if unknown
    handle = spec.launcher()(config, model_path=path)    # actors.vllm.engine.launch_vllm_engines

Adding an engine is one folder (its engine-rank actor on
:class:`~weight_transfer.engines.fence.CommandFence` and
:class:`~weight_transfer.engines.registered.RegisteredMemory`, and a launch
function returning a handle that owns what it started) and one call::

    register_engine("sglang", "my_pkg.sglang_launch", "launch_sglang_engines")

The command line's hooks for an engine (``wt demo``, ``wt bench``, the RL loop) are
tooling, not library: they are registered in :mod:`actors.tools.engine_tools`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One registered engine; see the module docstring."""

    name: str
    module: str  # the module of the launch function
    launch: str  # its name: launch(config, *, replicas=None, ...) -> a handle owning the actors
    demo_config: str = "configs/runs/demo.yaml"  # wt demo's default run config
    bench_config: str = "configs/runs/demo.yaml"  # wt bench designs' default run config
    kind: str | None = None  # how the demo names these engines (None: by their dtype)

    def launcher(self) -> Callable[..., Any]:
        """The launch function, imported now."""
        return getattr(importlib.import_module(self.module), self.launch)


_REGISTRY: dict[str, EngineSpec] = {}
DEFAULT_ENGINE = "reference"  # a run config's engine when it names none


def register_engine(name: str, module: str, launch: str, **options: Any) -> EngineSpec:
    """Register engine ``name`` (imported on first use); ValueError if the name is taken."""
    if not name or not name.replace("-", "_").isidentifier():
        raise ValueError(f"engine name {name!r}: must be a non-empty identifier (hyphens "
                         "allowed)")
    if name in _REGISTRY:
        raise ValueError(f"engine {name!r} is already registered (by {_REGISTRY[name].module})")
    spec = EngineSpec(name=name, module=module, launch=launch, **options)
    _REGISTRY[name] = spec
    return spec


def unregister_engine(name: str) -> None:
    """Forget engine ``name`` (a test's own engine, after the test)."""
    _REGISTRY.pop(name, None)


def engine_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def engine_spec(name: str) -> EngineSpec:
    """The engine registered as ``name``; ValueError listing the registered names."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown engine {name!r}; registered engines: "
                         f"{', '.join(engine_names())}")
    return spec


register_engine("reference", "actors.ready.launch", "launch_engines")
register_engine("vllm", "actors.vllm.engine", "launch_vllm_engines",
                demo_config="configs/runs/demo_vllm.yaml",
                bench_config="configs/runs/bench_vllm.yaml", kind="vllm, float32")
register_engine("vllm-server", "actors.vllm.served", "connect_vllm_servers",
                demo_config="configs/runs/demo_vllm_server.yaml",
                bench_config="configs/runs/bench_vllm.yaml", kind="vllm serve, float32")
