"""The tools' hooks per engine: what ``wt demo``, ``wt bench`` and the RL loop call for an
engine named in a run config.

The library's registry (:mod:`actors.engine_registry`) says how to launch an engine; this
table, which only tooling reads, names the command line's hooks as ``"module:attribute"``,
imported on first use. An engine without hooks is still launched by the library and driven
by a user's own loop::

    register_tools("sglang", start_fleet="my_pkg.demo:start_fleet")
    engine_tool("vllm", "check_bytes")(fleet, checks, problems, None)

The hooks: ``start_fleet`` and ``check_bytes`` (``wt demo``), ``bench`` (``wt bench
designs``' class), ``launch_replicas`` (the RL loop's engines, where starting them needs more
than the launch function: vLLM starts from the trainers' weights), ``sample_rollouts`` (the RL
loop), ``corrupt_one_byte`` (``wt demo --corrupt-version``).
"""

from __future__ import annotations

import importlib
from typing import Any

HOOKS = frozenset({"start_fleet", "check_bytes", "bench", "launch_replicas", "sample_rollouts",
                   "corrupt_one_byte"})
_TOOLS: dict[str, dict[str, str]] = {}


def register_tools(engine: str, **hooks: str) -> None:
    """Name the hooks of ``engine``; ValueError for an unknown hook or a reference that is not
    ``"module:attribute"``. Hooks registered earlier for the engine are kept unless renamed."""
    unknown = sorted(set(hooks) - HOOKS)
    if unknown:
        raise ValueError(f"engine {engine!r}: unknown hooks {unknown} (known: {sorted(HOOKS)})")
    bad = sorted(k for k, ref in hooks.items() if ref.count(":") != 1)
    if bad:
        raise ValueError(f"engine {engine!r}: hooks {bad} must be 'module:attribute'")
    _TOOLS.setdefault(engine, {}).update(hooks)


def unregister_tools(engine: str) -> None:
    """Forget the hooks of ``engine`` (a test's own engine, after the test)."""
    _TOOLS.pop(engine, None)


def has_tool(engine: str, name: str) -> bool:
    return name in _TOOLS.get(engine, {})


def engine_tool(engine: str, name: str) -> Any:
    """The hook ``name`` of ``engine``, imported now; ValueError naming the engine if it has
    none."""
    ref = _TOOLS.get(engine, {}).get(name)
    if ref is None:
        raise ValueError(f"engine {engine!r} has no {name!r} (it offers "
                         f"{sorted(_TOOLS.get(engine, {})) or 'none'})")
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


register_tools("reference", start_fleet="actors.tools.demo.fleet:start_fleet",
               check_bytes="actors.tools.demo.verify:check_bytes",
               bench="actors.tools.bench.designs.fleet:ReferenceBench",
               sample_rollouts="actors.tools.demo.rl_loop:reference_rollouts",
               corrupt_one_byte="actors.tools.demo.verify:corrupt_one_byte")
register_tools("vllm", start_fleet="actors.tools.demo.vllm_demo:start_fleet",
               check_bytes="actors.tools.demo.vllm_demo:check_bytes",
               bench="actors.tools.bench.designs.vllm:VllmBench",
               launch_replicas="actors.tools.demo.vllm_demo:launch_replicas",
               sample_rollouts="actors.tools.demo.vllm_demo:sample_rollouts")
register_tools("vllm-server", start_fleet="actors.tools.demo.vllm_server_demo:start_fleet",
               check_bytes="actors.tools.demo.vllm_server_demo:check_bytes")
