"""The layering rule, read from the source: ``actors -> scheduling -> weight_transfer``.

Every .py file of the project's packages is parsed with ``ast`` (imports inside
functions included) into an import graph between project modules:

- ``weight_transfer/`` (the core) imports no scheduling or actors, and no ``ray``;
- ``scheduling/`` (pure planning) imports no actors, and no ``ray``, ``torch`` or
  ``transformers``;
- the test scaffolding (``actors.tools.testkit``) is imported only by itself and by the
  harnesses that verify what they run (``actors.tools.bench``, ``actors.tools.demo``), never by
  the library;
- no import cycle between project modules: every import counts, those under
  ``if TYPE_CHECKING:`` and those inside functions too (a typing-only cycle is
  still two modules that know each other; the shared type belongs in a module
  both import, as ``weight_transfer.model.arch.shape`` and ``actors.tools.demo.fleet_handle``).

A subprocess then imports ``scheduling`` and every submodule and checks that
neither torch nor ray was loaded on the way.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("weight_transfer", "scheduling", "actors")

FORBIDDEN: dict[str, frozenset[str]] = {
    "weight_transfer": frozenset({"scheduling", "actors", "ray"}),
    "scheduling": frozenset({"actors", "ray", "torch", "transformers"}),
}
# Subpackages that may import the test scaffolding (actors.tools.testkit).
TESTING_USERS = ("actors.tools.testkit", "actors.tools.bench", "actors.tools.demo")


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # module name of the importing file
    target: str  # dotted name imported (a project module where it resolves to one)
    line: int
    runtime: bool  # False under `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def resolve(name: str, path: Path, node: ast.ImportFrom) -> list[str]:
    """Dotted names a ``from ... import ...`` statement loads."""
    base = node.module or ""
    if node.level:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    modules = project_modules()
    out = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    return out or [base]


def imports_of(name: str, path: Path) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runtime)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(name, a.name, node.lineno, runtime) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.extend(Import(name, t, node.lineno, runtime) for t in resolve(name, path, node))
        for child in ast.iter_child_nodes(node):
            visit(child, runtime)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return found


@cache
def all_imports() -> tuple[Import, ...]:
    return tuple(i for name, path in project_modules().items() for i in imports_of(name, path))


def project_target(target: str) -> str | None:
    """The project module ``target`` names (the longest existing prefix), or None."""
    modules = project_modules()
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def test_the_sources_are_found_and_parsed():
    modules = project_modules()
    for name in ("weight_transfer.transport.base", "scheduling.plan",
                 "actors.controller.controller",
                 "weight_transfer.engines.reference.loader", "actors.tools.testkit.harness",
                 "actors.tools.cli.main"):
        assert name in modules, name
    graph = import_graph()
    ctl, setup = "actors.controller.controller", "actors.controller.setup"
    assert {"ray", setup, "weight_transfer.errors"} <= {
        i.target for i in all_imports() if i.importer == ctl}
    assert {setup, "weight_transfer.errors"} <= graph[ctl]
    assert {"actors.controller.schedule_actor", "weight_transfer.types"} <= graph[setup]
    assert "ray" not in graph[ctl]  # third-party names are no graph nodes


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(layer):
    bad = [
        f"{ROOT.joinpath(*i.importer.split('.'))}: line {i.line} imports {i.target}"
        for i in all_imports()
        if i.importer.split(".")[0] == layer and i.target.split(".")[0] in FORBIDDEN[layer]
    ]
    assert not bad, f"{layer}/ may not import {sorted(FORBIDDEN[layer])}:\n" + "\n".join(bad)


MODULE_REF = re.compile(r"^[A-Za-z_]\w*(\.\w+)*(:\w+)?$")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_names_no_module_above_it(layer):
    """No lazy back door: a string naming a module (``"pkg.mod"`` or ``"pkg.mod:attr"``)
    of a layer above, to be imported on use, is an import all the same."""
    bad = []
    for name, path in project_modules().items():
        if name.split(".")[0] != layer:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and MODULE_REF.match(node.value)):
                continue
            target = project_target(node.value.partition(":")[0])
            if target and target.split(".")[0] in FORBIDDEN[layer]:
                bad.append(f"{path}: line {node.lineno} names {node.value!r}")
    assert not bad, f"{layer}/ may not name modules of {sorted(FORBIDDEN[layer])}:\n" + (
        "\n".join(bad))


def test_only_harnesses_import_the_test_scaffolding():
    bad = [
        f"{ROOT.joinpath(*i.importer.split('.'))}: line {i.line} imports {i.target}"
        for i in all_imports()
        if (i.target == "actors.tools.testkit" or i.target.startswith("actors.tools.testkit."))
        and not any(i.importer == u or i.importer.startswith(u + ".") for u in TESTING_USERS)
    ]
    assert not bad, "only " + ", ".join(TESTING_USERS) + " may import actors.tools.testkit:\n" + (
        "\n".join(bad))


def is_tools(name: str) -> bool:
    return name == "actors.tools" or name.startswith("actors.tools.")


def test_the_library_neither_imports_nor_names_the_tools():
    """Tooling is not library: nothing outside ``actors.tools`` imports it or names one of its
    modules in a string (a lazy import all the same)."""
    bad = [f"{ROOT.joinpath(*i.importer.split('.'))}: line {i.line} imports {i.target}"
           for i in all_imports() if is_tools(i.target) and not is_tools(i.importer)]
    for name, path in project_modules().items():
        if is_tools(name):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and MODULE_REF.match(node.value)
                    and is_tools(project_target(node.value.partition(":")[0]) or "")):
                bad.append(f"{path}: line {node.lineno} names {node.value!r}")
    assert not bad, "library code may not use actors.tools:\n" + "\n".join(bad)


MAX_MODULES = 15


def test_no_package_is_a_flat_pile_of_modules():
    """Folders are the architecture: a package with more modules than this wants subpackages."""
    crowded = {}
    for pkg in PACKAGES:
        for init in (ROOT / pkg).rglob("__init__.py"):
            n = sum(1 for p in init.parent.glob("*.py") if p.name != "__init__.py")
            if n > MAX_MODULES:
                crowded[str(init.parent.relative_to(ROOT))] = n
    assert not crowded, f"packages with more than {MAX_MODULES} modules: {crowded}"


def test_scripts_is_no_package():
    assert not (ROOT / "scripts" / "__init__.py").exists()
    assert not any(i.target.split(".")[0] == "scripts" for i in all_imports())


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module or a self-loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1 or node in graph[node]:
                    out.append(sorted(comp))
    return out


def one_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component."""
    members, start = set(comp), comp[0]
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:  # breadth first
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                path = [node]
                while (up := parent[path[-1]]) is not None:
                    path.append(up)
                return [*reversed(path), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{comp} is not strongly connected")


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in project_modules()}
    for i in all_imports():
        target = project_target(i.target)
        if target is not None and target != i.importer:  # TYPE_CHECKING imports count
            graph[i.importer].add(target)
    return graph


def test_strongly_connected_finds_cycles_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert strongly_connected(graph) == [["a", "b", "c"], ["e"]]
    assert one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_imports_under_type_checking_and_in_functions_are_edges(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n"
                      "    from weight_transfer.model.models import ModelConfig\n"
                      "def f():\n    import scheduling.plan\n")
    found = {(i.target, i.runtime) for i in imports_of("probe", source)}
    assert ("weight_transfer.model.models", False) in found
    assert ("scheduling.plan", True) in found
    graph = import_graph()  # the project's own type-only imports are edges as well
    assert "weight_transfer.model.arch.shape" in graph["weight_transfer.model.arch.base"]


def test_no_import_cycles_between_project_modules():
    graph = import_graph()
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles between project modules:\n" + "\n".join(
        f"  {sorted(comp)}: {' -> '.join(one_cycle(graph, comp))}" for comp in cycles)


@pytest.mark.slow  # a fresh interpreter that imports the whole package
def test_importing_scheduling_loads_neither_torch_nor_ray():
    code = (
        "import importlib, pkgutil, sys\n"
        "import scheduling\n"
        "names = [m.name for m in pkgutil.walk_packages(scheduling.__path__, 'scheduling.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names), sorted(m for m in ('torch', 'ray', 'transformers')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    count, loaded = done.stdout.split(" ", 1)
    assert int(count) >= 8, done.stdout  # every submodule was imported
    assert loaded.strip() == "[]", f"importing scheduling loaded {loaded.strip()}"


def test_no_two_test_modules_share_a_name():
    """pytest imports test modules by their file name (no packages under tests/): two
    modules of one name in different folders fail the whole run at collection."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in seen.items() if len(p) > 1} == {}
