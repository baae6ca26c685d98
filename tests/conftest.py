"""Shared fixtures, the test tiers and the skips for hardware the machine lacks.

Tiers, chosen with markers (declared in pyproject.toml)::

    pytest -m "not slow"       # the fast unit tier alone: pure, no Ray, well under a minute
    pytest -m integration      # tests/integration/: local Ray, simulated NICs, spawned targets
    pytest                     # everything, one process
    pytest -n 2 --dist loadfile   # everything on two workers, a module per worker
                               # (what scripts/test.sh and CI run)

- ``slow``: starts Ray, spawns a process that imports the project (torch, Ray),
  or takes more than a few seconds. :func:`pytest_collection_modifyitems` puts
  ``integration`` and ``slow`` on everything under ``tests/integration/`` and
  slow unit tests carry ``@pytest.mark.slow`` (or ``pytestmark``) themselves.
- ``pyverbs``: needs pyverbs importable (no device); skipped with
  "pyverbs not importable: <why>".
- ``rdma``: needs an RDMA device (``WT_RDMA_DEVICE`` names one, default the
  first); skipped with "pyverbs not importable: <why>" or "no RDMA device: <why>".
- ``vllm``: starts a real vLLM engine; skipped with "vllm cannot be imported: <why>"
  where vLLM is not installed or broken (checked when such a test runs, so
  collecting the suite does not import vLLM).
- ``gpu`` and ``mooncake`` tests skip themselves with the reason.

``WT_TEST_HIDE_PYVERBS=1`` runs the tests as on a machine without pyverbs (the
pure RDMA tests run, the others skip), where pyverbs is installed.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# One intra-op thread per process, set before anything imports torch and inherited by every
# process the suite starts (Ray nodes and their workers, `wt` commands, spawned ranks, vLLM):
# the suite runs dozens of processes on two cores, where torch's default of one OpenMP
# thread per core makes each process's threads spin-wait on the others' (the unit tier
# took 111 CPU-s with the default, 89 with one thread). Ray already gives its actors one
# thread unless they ask for more CPUs; the test process and its subprocesses did not.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Ray cluster and driver of the suite in token mode from the start (the token is made
# in pytest_configure). Left unset, a cluster started with ray.cluster_utils.Cluster (the
# shared cluster of tests/integration/conftest.py, the multi-node ones) takes no token at
# all: a driver without one connected and ran tasks. And a process's first
# ``ray.init(address="local")`` turns token mode on for that process alone (Ray sets
# RAY_AUTH_MODE=token in os.environ), after which it could no longer use such a cluster.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Bytecode caches written, CPython's default, also where the environment turns them off
# (PYTHONDONTWRITEBYTECODE): otherwise each of the some 400 processes the suite starts
# compiles every module of this project it imports again, and every xdist worker rewrites
# every test module again (2.5 CPU-s each) when it collects.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

import pytest

from actors.tools.testkit.harness import RemoteTarget
from weight_transfer.transport.simnic.nic import SimNic

# The cyclic garbage collector's thresholds for every process the suite starts (Python
# reads tests/pythonpath/sitecustomize.py at start-up; why there): this process and the
# xdist workers included.
PYTHONPATH_DIR = Path(__file__).parent / "pythonpath"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(PYTHONPATH_DIR), os.environ.get("PYTHONPATH")) if p)
runpy.run_path(str(PYTHONPATH_DIR / "sitecustomize.py"))

# DeepSpeed's JIT-built shared-memory op, built by scripts/setup.sh into this checkout's venv:
# one cache per checkout (torch keys a build by its paths, so two checkouts sharing
# ~/.cache/torch_extensions rebuild it in turn, inside the first test's trainer actors).
# Every process the suite starts inherits it (Ray nodes, actors, `wt` commands).
_VENV = Path(__file__).resolve().parents[1] / ".venv"
if _VENV.is_dir():
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_VENV / "torch_extensions"))

if os.environ.get("WT_TEST_HIDE_PYVERBS") == "1":
    sys.modules["pyverbs"] = None  # every `import pyverbs...` now raises ImportError

INTEGRATION_DIR = Path(__file__).parent / "integration"

# Unit tests that take more than a few seconds of CPU on the 2-core machines, or
# start a fresh interpreter that imports torch or Ray: node ids without their
# parameters, or whole modules.


def pytest_configure(config: pytest.Config) -> None:
    """Ray's token exists (mode 0600) before any test starts a cluster: with pytest-xdist
    (``scripts/test.sh`` runs two workers) two workers starting their first local clusters
    at once would otherwise both generate one. Done once, in the controlling process."""
    if not hasattr(config, "workerinput"):
        from actors.tools.ray_token import private_token

        private_token(new_cluster=True)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects on the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(INTEGRATION_DIR):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)
    # the modules that share actors across modules run together, in their group's order
    # (tests/xdist_order.py GROUPS); the same order on every xdist worker
    from xdist_order import group_order

    items[:] = [items[i] for i in group_order([item.nodeid for item in items])]


MODULE_SECONDS = Path(__file__).parent / "module_seconds.json"
_RUN_SECONDS: list[tuple[str, float]] = []  # (node id, seconds) of this run's test phases


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--save-module-seconds", metavar="PATH", type=Path, default=None,
        help="write each module's seconds (setup, call and teardown summed) into the table "
             "at PATH (tests/module_seconds.json orders the modules on xdist workers: "
             "tests/xdist_order.py); modules not run keep their rows")


@pytest.hookimpl(optionalhook=True)  # a run without xdist (``-p no:xdist``) has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (``scripts/test.sh``): the costliest modules first, by the last
    measured run (``tests/xdist_order.py``, beside this file)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist_order import CostFirstScheduling, load_module_seconds

    return CostFirstScheduling(config, log, seconds=load_module_seconds(MODULE_SECONDS),
                               heavy_slots=os.cpu_count() or 1)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _RUN_SECONDS.append((report.nodeid, report.duration))


@functools.cache
def pyverbs_missing() -> str | None:
    """Why pyverbs cannot be imported here, or None."""
    from weight_transfer.transport.rdma.verbs import RdmaUnavailableError, import_pyverbs

    try:
        import_pyverbs()
    except RdmaUnavailableError as exc:
        return str(exc)
    return None


@functools.cache
def rdma_device_missing() -> str | None:
    """Why there is no usable RDMA device (pyverbs is importable), or None."""
    from weight_transfer.transport.rdma.verbs import rdma_unavailable_reason

    return rdma_unavailable_reason(os.environ.get("WT_RDMA_DEVICE") or None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    needs_device = item.get_closest_marker("rdma") is not None
    needs_pyverbs = needs_device or item.get_closest_marker("pyverbs") is not None
    if needs_pyverbs and (why := pyverbs_missing()) is not None:
        pytest.skip(f"pyverbs not importable: {why}")
    if needs_device and (why := rdma_device_missing()) is not None:
        pytest.skip(f"no RDMA device: {why}")
    if item.get_closest_marker("vllm") is not None:
        from actors.tools.testkit.vllm_oracle import vllm_missing

        if (why := vllm_missing()) is not None:
            pytest.skip(why)


_MODULE_START: dict[Any, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``WT_SUITE_TIMELINE`` set (``scripts/suite_cpu.py --modules``): each module's
    span (its first test's set-up to its last test's teardown, module fixtures included) is
    appended to that file, for the CPU sampler to give each process's CPU time to a module
    (:func:`actors.tools.testkit.cpu_profile.by_module`)."""
    path = os.environ.get("WT_SUITE_TIMELINE")
    if not path:
        yield
        return
    from actors.tools.testkit.cpu_profile import uptime_s

    _MODULE_START.setdefault(item.path, uptime_s())
    yield
    if nextitem is None or nextitem.path != item.path:
        start = _MODULE_START.pop(item.path, uptime_s())
        module = os.path.relpath(item.path, Path(__file__).parents[1])
        with open(path, "a") as f:  # one short line per write: appends do not interleave
            f.write(f"{os.getpid()}\t{module}\t{start:.2f}\t{uptime_s():.2f}\n")


@pytest.fixture
def make_simnic() -> Iterator[Callable[..., SimNic]]:
    """Build SimNic objects (keywords as for SimNic); all are closed after the test."""
    nics: list[SimNic] = []

    def make(**kwargs: Any) -> SimNic:
        kwargs.setdefault("owner", f"proc{len(nics)}")
        nic = SimNic(**kwargs)
        nics.append(nic)
        return nic

    yield make
    for nic in nics:
        nic.close()


@pytest.fixture
def make_target() -> Iterator[Callable[..., RemoteTarget]]:
    """Start RemoteTarget processes (arguments as for RemoteTarget); all are closed after."""
    targets: list[RemoteTarget] = []

    def make(*args: Any, **kwargs: Any) -> RemoteTarget:
        target = RemoteTarget(*args, **kwargs)
        target.start()
        targets.append(target)
        return target

    yield make
    for target in targets:
        target.close()


# vLLM and the triton it imports can crash the interpreter's own teardown after the
# last test (a segmentation fault from native module finalizers, seen once in a whole
# run, after every test had passed and the summary was printed), which would turn a
# passing run into exit code 139. Where vLLM was imported into this process, the
# session's verdict is final once pytest has reported: flush and leave with it.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))
    path = session.config.getoption("--save-module-seconds")
    if path is not None and not hasattr(session.config, "workerinput"):
        from xdist_order import (
            load_module_seconds,
            merge_module_seconds,
            module_seconds,
            save_module_seconds,
        )

        # The rows of modules no longer in tests/ (removed, renamed) go.
        root = Path(session.config.rootpath)
        modules = {str(p.relative_to(root)) for p in Path(__file__).parent.rglob("test_*.py")}
        save_module_seconds(path, merge_module_seconds(
            load_module_seconds(path), module_seconds(_RUN_SECONDS), modules))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # Not in a pytest-xdist worker: its results travel to the controller over a channel
    # that os._exit could cut before the last message is out.
    if "vllm" in sys.modules and _EXIT_STATUS and not hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
