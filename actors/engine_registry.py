"""The engine registry: an inference engine's name, resolved once, to what launches it.

It lives in ``actors`` because everything it names does: the launch functions that start
engine-rank actors and the command line's hooks. The core (``weight_transfer.engines``)
holds the engine-rank contract and its shared implementation, and names no engine.

Every place that needs an engine by name (a run config's ``engine``, ``wt demo
--engine``, ``wt bench designs``, the RL loop) asks :func:`engine_spec`; nothing
else compares engine names. A spec names modules and attributes as strings and
imports them on first use, so this module imports no engine or Ray::

    spec = engine_spec("vllm")               # ValueError listing the names if unknown
    handle = spec.launcher()(config, model_path=path)    # actors.vllm_engine.launch_vllm_engines
    start_fleet = spec.tool("start_fleet")   # the command line's hooks for this engine

Adding an engine is one folder (its engine-rank actor on
:class:`~weight_transfer.engines.fence.CommandFence` and
:class:`~weight_transfer.engines.registered.RegisteredMemory`, and a launch
function returning a handle that owns what it started) and one call::

    register_engine("sglang", "my_pkg.sglang_launch", "launch_sglang_engines")

``tools`` are the optional hooks of the command line (``"module:attribute"``):
``start_fleet`` and ``check_bytes`` (``wt demo``), ``bench`` (``wt bench
designs``' class), ``launch_replicas`` (the RL loop's engines, where starting them needs more
than the launch function: vLLM starts from the trainers' weights) and ``sample_rollouts``
(the RL loop),
``corrupt_one_byte`` (``wt demo --corrupt-version``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One registered engine; see the module docstring."""

    name: str
    module: str  # the module of the launch function
    launch: str  # its name: launch(config, *, replicas=None, ...) -> a handle owning the actors
    tools: Mapping[str, str] = field(default_factory=dict)  # hook name -> "module:attribute"
    demo_config: str = "configs/runs/demo.yaml"  # wt demo's default run config
    bench_config: str = "configs/runs/demo.yaml"  # wt bench designs' default run config
    kind: str | None = None  # how the demo names these engines (None: by their dtype)

    def launcher(self) -> Callable[..., Any]:
        """The launch function, imported now."""
        return getattr(importlib.import_module(self.module), self.launch)

    def has_tool(self, name: str) -> bool:
        return name in self.tools

    def tool(self, name: str) -> Any:
        """The hook ``name``, imported now; ValueError naming the engine if it has none."""
        ref = self.tools.get(name)
        if ref is None:
            raise ValueError(f"engine {self.name!r} has no {name!r} (it offers "
                             f"{sorted(self.tools) or 'none'})")
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[str, EngineSpec] = {}
DEFAULT_ENGINE = "reference"  # a run config's engine when it names none


def register_engine(name: str, module: str, launch: str, *,
                    tools: Mapping[str, str] | None = None, **options: Any) -> EngineSpec:
    """Register engine ``name`` (imported on first use); ValueError if the name is taken or a
    tool is not ``"module:attribute"``."""
    if not name or not name.replace("-", "_").isidentifier():
        raise ValueError(f"engine name {name!r}: must be a non-empty identifier (hyphens "
                         "allowed)")
    if name in _REGISTRY:
        raise ValueError(f"engine {name!r} is already registered (by {_REGISTRY[name].module})")
    bad = sorted(k for k, ref in (tools or {}).items() if ref.count(":") != 1)
    if bad:
        raise ValueError(f"engine {name!r}: tools {bad} must be 'module:attribute'")
    spec = EngineSpec(name=name, module=module, launch=launch,
                      tools=MappingProxyType(dict(tools or {})), **options)
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


register_engine(
    "reference", "actors.launch", "launch_engines",
    tools={"start_fleet": "actors.demo.fleet:start_fleet",
           "check_bytes": "actors.demo.verify:check_bytes",
           "bench": "actors.bench.designs_fleet:ReferenceBench",
           "sample_rollouts": "actors.demo.rl_loop:reference_rollouts",
           "corrupt_one_byte": "actors.demo.verify:corrupt_one_byte"})
register_engine(
    "vllm", "actors.vllm_engine", "launch_vllm_engines",
    tools={"start_fleet": "actors.demo.vllm_demo:start_fleet",
           "check_bytes": "actors.demo.vllm_demo:check_bytes",
           "bench": "actors.bench.designs_vllm:VllmBench",
           "launch_replicas": "actors.demo.vllm_demo:launch_replicas",
           "sample_rollouts": "actors.demo.vllm_demo:sample_rollouts"},
    demo_config="configs/runs/demo_vllm.yaml", bench_config="configs/runs/bench_vllm.yaml",
    kind="vllm, float32")
register_engine(
    "vllm-server", "actors.vllm_served", "connect_vllm_servers",
    tools={"start_fleet": "actors.demo.vllm_server_demo:start_fleet",
           "check_bytes": "actors.demo.vllm_server_demo:check_bytes"},
    demo_config="configs/runs/demo_vllm_server.yaml",
    bench_config="configs/runs/bench_vllm.yaml", kind="vllm serve, float32")
