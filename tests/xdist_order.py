"""The suite's order on pytest-xdist workers: costliest modules first, heavy ones one per core.

``scripts/test.sh`` runs ``pytest -n 3 --dist loadfile``: each test module goes whole to one
worker. xdist's own ``loadfile`` hands the modules out by number of tests, most first, and
gives a worker its next module as soon as the current one has two tests left. On this suite
that leaves the heavy integration modules (a Ray fleet or a vLLM engine, one to five tests,
a minute or two each) among the last, where a worker can hold two or three of them queued
while the other has finished and a core idles.

:class:`CostFirstScheduling` hands out the module with the most seconds in the last measured
run first (longest-processing-time-first), modules with no measurement before every measured
one (a new module may be heavy: better at the start than alone at the end), and gives a
worker its next module only when its current one has a single test left (an xdist worker
runs a test only once it knows the next one, so one queued test is the least that keeps it
busy). With ``heavy_slots`` (``tests/conftest.py``: the machine's cores) never more heavy
modules (measured at :data:`LIGHT_S` or more) run at once than that: a worker beyond them
runs the light modules beside them, in the time the heavy ones wait (process and engine
starts, capped links, timeouts), and stops when no light module is left. On the 2-core
machines three workers so measured 755 s of pytest where two took 775 s on the same tree;
three without the limit ran three fleets at once and Ray nodes into their start timeout.

Modules that share actors across modules (:data:`GROUPS`: the reference fleet of
``tests/integration/conftest.py``) are one unit of work: one worker runs them one after the
other, in the group's order (:func:`group_order`, applied to the collection by
``tests/conftest.py``, so also without xdist), their seconds summed.

The seconds come from ``tests/module_seconds.json`` (:func:`load_module_seconds`),
written by ``pytest --save-module-seconds tests/module_seconds.json`` on a whole run
(:func:`module_seconds` of the run's reports, merged by :func:`merge_module_seconds`):
setup, call and teardown summed per module, as ``--durations=0`` shows them. A stale table
costs time, never a result: the order of modules does not change what a module tests.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadFileScheduling

__all__ = ["GROUPS", "CostFirstScheduling", "group_of", "group_order", "load_module_seconds",
           "merge_module_seconds", "module_of", "module_seconds", "save_module_seconds"]

FORMAT = 1
# Groups of modules that share actors across modules, each in the order they must run
# (a module that leaves the actors unfit for the others last), by path from the rootdir.
GROUPS: dict[str, tuple[str, ...]] = {
    "reference-fleet": (
        "tests/integration/test_actors.py",
        "tests/integration/test_integrity_faults.py",
        "tests/integration/test_replica_groups.py",
        "tests/integration/test_served_integrity.py",
        "tests/integration/test_tcp_fleet.py",
        # their engines hold a shadow from their shadow-mode set-up on: shadow modules only
        "tests/integration/test_delta.py",
        "tests/integration/test_shadow.py",
    ),
}
_GROUP_OF = {module: name for name, modules in GROUPS.items() for module in modules}


def module_of(nodeid: str) -> str:
    """The module (``loadfile``'s unit of work) a test's node id belongs to."""
    return nodeid.split("::", 1)[0]


def group_of(module: str) -> str | None:
    """The group (:data:`GROUPS`) ``module`` runs in, or None."""
    return _GROUP_OF.get(module)


def group_order(nodeids: list[str]) -> list[int]:
    """The positions of ``nodeids`` (a collection) in the order to run them: each group's
    tests together where its first module's were, its modules in the group's order; the
    rest unchanged."""
    by_module: dict[str, list[int]] = {}
    for i, nodeid in enumerate(nodeids):
        by_module.setdefault(module_of(nodeid), []).append(i)
    out: list[int] = []
    placed: set[str] = set()
    for i, nodeid in enumerate(nodeids):
        module = module_of(nodeid)
        group = group_of(module)
        if group is None:
            out.append(i)
        elif group not in placed:
            placed.add(group)
            for member in GROUPS[group]:
                out += by_module.get(member, [])
    return out


def module_seconds(reports: Iterable[tuple[str, float]]) -> dict[str, float]:
    """(node id, seconds) of every setup, call and teardown -> seconds per module."""
    out: dict[str, float] = {}
    for nodeid, seconds in reports:
        module = module_of(nodeid)
        out[module] = out.get(module, 0.0) + float(seconds)
    return out


def load_module_seconds(path: Path) -> dict[str, float]:
    """The table in ``path``; {} where there is none. A table that does not parse is a
    ValueError naming the file: the suite must not run in an order nobody chose."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        table = data["modules"]
        if not isinstance(table, dict):
            raise ValueError("'modules' is not a mapping")
        out = {str(k): float(v) for k, v in table.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a module-seconds table ({exc}); write it again with "
                         f"pytest --save-module-seconds {path}") from exc
    if bad := sorted(k for k, v in out.items() if not math.isfinite(v) or v < 0):
        raise ValueError(f"{path}: modules with no finite, non-negative seconds: {bad}")
    return out


def merge_module_seconds(old: Mapping[str, float], new: Mapping[str, float],
                         collected: Iterable[str]) -> dict[str, float]:
    """``old`` with the modules measured in ``new`` replaced, and those no longer collected
    (removed or renamed) dropped; a module collected but not run this time keeps its row."""
    keep = set(collected)
    out = {k: v for k, v in old.items() if k in keep}
    out.update(new)
    return dict(sorted(out.items()))


def save_module_seconds(path: Path, table: Mapping[str, float]) -> None:
    data = {"format": FORMAT,
            "modules": {k: round(v, 1) for k, v in sorted(table.items())}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)  # never a half-written table


LIGHT_S = 8.0  # a module measured under this many seconds is light (no Ray fleet, no engine)


class CostFirstScheduling(LoadFileScheduling):
    """``--dist loadfile`` with the costliest module first and one test held back; with
    ``heavy_slots``, never more heavy modules at once than that (one per core): a worker
    beyond them runs the light modules beside them, and stops when none is left."""

    def __init__(self, config: Any, log: Any = None, *,
                 seconds: Mapping[str, float], heavy_slots: int | None = None) -> None:
        super().__init__(config, log)
        self._seconds = dict(seconds)
        self._heavy_slots = heavy_slots

    def _split_scope(self, nodeid: str) -> str:
        """A test's unit of work: its module, or the group (:data:`GROUPS`) of its module."""
        module = module_of(nodeid)
        return group_of(module) or module

    def cost(self, scope: str) -> float:
        """A module's (a group's: its modules') seconds in the table; unmeasured modules sort
        before every measured."""
        modules = GROUPS.get(scope, (scope,))
        return sum(self._seconds.get(m, math.inf) for m in modules)

    def heavy(self, scope: str) -> bool:
        return self.cost(scope) >= LIGHT_S

    def _heavy_elsewhere(self, node: Any) -> int:
        """The other workers with a heavy module to finish (each runs one module at a time)."""
        return sum(1 for other, work in self.assigned_work.items() if other is not node
                   and any(self.heavy(scope) and not all(unit.values())
                           for scope, unit in work.items()))

    def _next_scope(self, node: Any) -> str | None:
        if not self.workqueue:
            return None
        # sorted() is stable with reverse: xdist's order (most tests first) breaks ties
        order = sorted(self.workqueue, key=self.cost, reverse=True)
        if self._heavy_slots is None or self._heavy_elsewhere(node) < self._heavy_slots:
            return order[0]
        return next((scope for scope in order if not self.heavy(scope)), None)

    def _assign_work_unit(self, node: Any) -> None:
        scope = self._next_scope(node)
        if scope is None:  # every slot runs a heavy module and no light one is left
            node.shutdown()
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid)
                                for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        # The one pending test is the one the worker holds until it knows the next.
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)
