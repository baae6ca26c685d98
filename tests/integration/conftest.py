"""One local Ray cluster for the integration modules that need no Ray of their own.

Starting and stopping a local Ray instance costs about 6 s on the 2-core machines;
connecting a new driver to a running cluster about half a second. So the modules
whose fixtures used ``ray.init(address="local", ...)`` with nothing special take
:func:`ray_job` instead: the module gets a Ray driver of its own (a Ray job) on one
session-wide cluster of :data:`CLUSTER_CPUS` logical CPUs on loopback. When the
module's driver disconnects, Ray ends its job and with it every actor and
placement group the module created, so each module still starts on an idle
cluster (:func:`ray_job` waits for every CPU to be free again, and fails naming
what is held if they are not).

Modules that need a Ray of their own keep it: a ``ray.cluster_utils.Cluster`` of
several nodes (multinode, two hosts), a ``ray start`` cluster (job submit), Ray's
metrics agent on a known port (observability), and a ``wt`` command run as a
subprocess that starts Ray itself (a ``wt`` subprocess whose subject is not that joins the
shared cluster as a job of its own through ``RAY_ADDRESS``). They run beside the shared
cluster, which stays up, idle, until the session ends: an idle cluster uses about 0.03 of a
core, a stop and a start about 6 s and 5 CPU-s (stopped before each such module, each
worker's cluster started about eight times a run).

"Session-wide" is per pytest process: under pytest-xdist (``scripts/test.sh``: three
workers, a whole module per worker) each worker starts its own shared cluster when
its first such module runs, so several Ray clusters can run at once on the machine. No
test joins a cluster it did not start: every ``ray.init`` names its address (the
shared cluster's, one it started, or ``"local"`` for a new instance), never
``"auto"`` or nothing, and Ray's token exists before the workers start
(``tests/conftest.py``). The shared cluster starts no log monitor: no driver of it
asks for its workers' logs (``log_to_driver=False``), and the monitor's polling of
every worker's log file took about a fifth of the CPU Ray's own processes used in a
run.

The modules of the ``reference-fleet`` group (``tests/xdist_order.py`` GROUPS: actors,
integrity faults, replica groups, served integrity, the tcp fleet, delta, shadow) share one
set of actors instead of each starting its own (a start costs about 15 CPU-s and 8 s here):
:func:`reference_fleet` gives each the same trainers and engines (tiny_llama, 2 FSDP2
trainer ranks -> 2 replicas x TP2 of the reference engine, simnic, the fault-hook classes),
on the shared cluster through a driver of its own that stays connected from the group's
first module to its last (they run one after the other, on one worker). Each module builds
its own controllers over them, with its own options, and shuts them down; between modules
every rank's NICs are closed (the next controller registers and connects anew, with its own
transport options), paused engines resumed, and a fleet with a dead actor replaced, as is
one whose engines hold a shadow (:meth:`ReferenceFleet.hold_shadow`) for a module that
updates in place (one without ``FLEET_SHADOW_ONLY = True``). After the group's last module
the driver disconnects and the actors end with its job.

The vLLM modules share their set-up through ``vllm_fleet.py`` beside this file
(config, trainers, engines, controller, the byte oracle) and :func:`vllm_trainers`
(trainers for the modules whose engine the user's own actor starts).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from xdist_order import group_of, module_of  # tests/

from actors.tools.demo.fleet import LOCAL_NODE_IP

CLUSTER_CPUS = 16  # the most any module asked its local instance for
OBJECT_STORE_BYTES = 4 << 30  # ray.cluster_utils defaults to 150 MiB; local Ray to ~30% RAM
IDLE_TIMEOUT_S = 60.0
START_ATTEMPTS = 3


class SharedCluster:
    """The session's Ray cluster, started on first use and stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self._cluster: Any = None

    @property
    def address(self) -> str:
        if self._cluster is None:
            from ray.cluster_utils import Cluster

            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    self._cluster = Cluster(initialize_head=True, head_node_args={
                        "num_cpus": CLUSTER_CPUS, "node_ip_address": LOCAL_NODE_IP,
                        "include_dashboard": False, "include_log_monitor": False,
                        "object_store_memory": OBJECT_STORE_BYTES})
                    break
                except Exception as exc:
                    # Ray waits a fixed 30 s for its raylet to register (ray/_private/node.py);
                    # on the loaded 2-core machines the first start of a worker can miss it.
                    if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS:
                        raise
                    warnings.warn(f"shared Ray cluster: start {attempt} of {START_ATTEMPTS} "
                                  f"timed out ({exc}); starting it again", stacklevel=2)
        return self._cluster.address

    def stop(self) -> None:
        if self._cluster is not None:
            if ray.is_initialized():
                ray.shutdown()
            self._cluster.shutdown()
            self._cluster = None


_SHARED = SharedCluster()


@pytest.fixture(scope="session")
def shared_ray_cluster() -> Iterator[SharedCluster]:
    """The session's cluster (started by the first module that asks), stopped at its end."""
    try:
        yield _SHARED
    finally:
        _FLEET.close()
        _SHARED.stop()


def _wait_idle(timeout_s: float) -> None:
    """Every CPU of the cluster free: the previous module's job has been cleaned up."""
    deadline = time.monotonic() + timeout_s
    total = ray.cluster_resources().get("CPU", 0.0)
    while (free := ray.available_resources().get("CPU", 0.0)) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"shared Ray cluster: {total - free:g} of {total:g} CPUs still held "
                f"{timeout_s:g} s after the previous module's job ended")
        time.sleep(0.2)


def _connect(shared: SharedCluster) -> None:
    """A driver of this process on the shared cluster, once the cluster is idle."""
    ray.init(address=shared.address, _node_ip_address=LOCAL_NODE_IP,
             log_to_driver=False, logging_level="WARNING")
    try:
        _wait_idle(IDLE_TIMEOUT_S)
    except BaseException:
        ray.shutdown()
        raise


@pytest.fixture(scope="module")
def ray_job(shared_ray_cluster: SharedCluster) -> Iterator[None]:
    """This module's own Ray driver on the shared cluster; its actors die with it."""
    _FLEET.close()  # a group's driver still connected (a group cut short): its actors end
    _connect(shared_ray_cluster)
    try:
        yield
    finally:
        ray.shutdown()


REFERENCE_MODEL = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny_llama.yaml"
FLEET_GROUP = "reference-fleet"


class ReferenceFleet:
    """The actors of the ``reference-fleet`` modules (module docstring): ``trainers`` and
    ``replicas`` (launch handles), :meth:`config` for a module's controllers."""

    def __init__(self) -> None:
        self.trainers: Any = None
        self.replicas: Any = None
        self._cluster_file: Path | None = None
        self._shadow = False

    @property
    def is_open(self) -> bool:
        return self.trainers is not None

    @property
    def cluster_file(self) -> Path | None:
        """The cluster YAML the fleet was launched with (2 trainers -> 2 replicas x TP2)."""
        return self._cluster_file

    def config(self, **options: Any) -> Any:
        """A :class:`~actors.TransferConfig` of the fleet's model and cluster with a module's
        own ``options`` (the controller's: timeouts, integrity, retries, groups, apply)."""
        from actors import TransferConfig

        return TransferConfig.from_files(REFERENCE_MODEL, self._cluster_file, **options)

    def open(self, shared: SharedCluster, cluster_file: Path, *,
             shadow_only: bool = False) -> ReferenceFleet:
        """The fleet for the next module: the running one if every actor answers and, for a
        module that updates in place (not ``shadow_only``), none holds a shadow; else a new
        one (with its driver)."""
        if self.is_open and ((self._shadow and not shadow_only) or not self._alive()):
            self.close()
        if not self.is_open:
            from actors import launch_engines, launch_trainers
            from actors.tools.testkit.hooks import FaultyInferenceActor, FaultyTrainerActor

            self._cluster_file, self._shadow = cluster_file, False
            _connect(shared)
            try:
                cfg = self.config()
                self.trainers = launch_trainers(cfg, actor_cls=FaultyTrainerActor)
                self.replicas = launch_engines(cfg, actor_cls=FaultyInferenceActor)
            except BaseException:
                self.close()
                raise
        return self

    def hold_shadow(self) -> None:
        """The engines hold a shadow from now on (a shadow-mode set-up gave them one, and
        they keep it): a later module that updates in place gets new actors."""
        self._shadow = True

    def _ranks(self) -> list[Any]:
        return [*self.trainers, *(a for replica in self.replicas for a in replica)]

    def _alive(self) -> bool:
        try:
            ray.get([a.__ray_ready__.remote() for a in self._ranks()], timeout=30)
        except Exception:  # a dead actor, or one that does not answer
            return False
        return True

    def reset(self) -> None:
        """After a module: every rank's NICs closed (fault hooks with them), every paused
        engine resumed (its version kept); a fleet that fails that is closed."""
        if not self.is_open:
            return
        from actors.controller.engine_control import next_epoch

        try:
            ranks = self._ranks()
            ray.get([a.wt_close.remote() for a in ranks], timeout=60)
            engines = ranks[len(self.trainers):]
            paused = ray.get([a.wt_paused.remote() for a in engines], timeout=30)
            ray.get([a.wt_resume.remote(epoch=next_epoch())
                     for a, p in zip(engines, paused, strict=True) if p], timeout=30)
        except Exception as exc:
            warnings.warn(f"reference fleet: reset failed ({exc}); a new one for the next "
                          "module", stacklevel=2)
            self.close()

    def close(self) -> None:
        """Disconnect the fleet's driver: its actors end with its job."""
        handles = [h for h in (self.replicas, self.trainers) if h is not None]
        self.trainers = self.replicas = None
        try:
            for handle in handles:
                handle.close()
        finally:
            if handles and ray.is_initialized():
                ray.shutdown()


_FLEET = ReferenceFleet()


@pytest.fixture(scope="module")
def reference_fleet(request: pytest.FixtureRequest, shared_ray_cluster: SharedCluster,
                    cluster_file: Any) -> Iterator[Any]:
    """The ``reference-fleet`` group's actors for this module (module docstring)."""
    fleet = _FLEET.open(shared_ray_cluster, cluster_file(trainers=2, replicas=2, tp=2),
                        shadow_only=getattr(request.module, "FLEET_SHADOW_ONLY", False))
    try:
        yield fleet
    finally:
        fleet.reset()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of a group's last module to run here (its fixtures finalized):
    the group's actors end."""
    try:
        return (yield)
    finally:
        if _FLEET.is_open and (nextitem is None
                               or group_of(module_of(nextitem.nodeid)) != FLEET_GROUP):
            _FLEET.close()


@pytest.fixture(scope="module")
def vllm_trainers(ray_job: None) -> Iterator[Any]:
    """The module's trainers of tiny_llama in float32 for one vLLM replica at TP=1
    (``configs/clusters/vllm_cpu_tp1.yaml``), on the shared cluster; closed after it."""
    from vllm_fleet import tiny_llama_config  # tests/integration is on sys.path

    from actors import launch_trainers

    with launch_trainers(tiny_llama_config("vllm_cpu_tp1.yaml")) as handle:
        yield handle


@pytest.fixture(scope="session")
def cluster_file(tmp_path_factory: Any) -> Any:
    """``cluster_file(trainers=, replicas=, tp=)``: ``configs/clusters/local_cpu.yaml`` on
    one trainer node of ``trainers`` ranks -> ``replicas`` x TP ``tp``, in a temporary
    directory; for tests whose subject is not the shape (every trainer and engine actor
    started costs a few seconds of CPU on the 2-core machines)."""
    return lambda **shape: _cluster_file(tmp_path_factory.mktemp("clusters"), **shape)


def _cluster_file(tmp_path: Any, *, trainers: int, replicas: int, tp: int) -> Any:
    import yaml

    from actors.tools.demo.run_config import ROOT

    data = yaml.safe_load((ROOT / "configs" / "clusters" / "local_cpu.yaml").read_text())
    data["trainer"].update(nodes=1, gpus_per_node=trainers, expert_parallel=1)
    data["inference"].update(replicas=replicas, gpus_per_replica=tp, tensor_parallel=tp)
    path = tmp_path / f"local_cpu_{trainers}x{replicas}x{tp}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def smallest_demo_run(tmp_path: Any) -> Any:
    """``configs/runs/demo.yaml`` on the demo's smallest shape
    (``configs/clusters/local_cpu_small.yaml``: 2 trainer ranks -> 1 replica x TP1), written
    under ``tmp_path``: for benchmarks tested as smoke runs (the shape is not their subject)."""
    import yaml

    from actors.tools.demo.run_config import ROOT

    data = yaml.safe_load((ROOT / "configs" / "runs" / "demo.yaml").read_text())
    data["cluster"] = "configs/clusters/local_cpu_small.yaml"
    path = tmp_path / "demo-smallest.yaml"
    path.write_text(yaml.safe_dump(data))
    return path

