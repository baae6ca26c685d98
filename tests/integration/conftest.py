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

The vLLM modules share their set-up through ``vllm_fleet.py`` beside this file
(config, trainers, engines, controller, the byte oracle) and :func:`vllm_trainers`
(trainers for the modules whose engine the user's own actor starts).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import ray

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


@pytest.fixture(scope="module")
def ray_job(shared_ray_cluster: SharedCluster) -> Iterator[None]:
    """This module's own Ray driver on the shared cluster; its actors die with it."""
    ray.init(address=shared_ray_cluster.address, _node_ip_address=LOCAL_NODE_IP,
             log_to_driver=False, logging_level="WARNING")
    try:
        _wait_idle(IDLE_TIMEOUT_S)
        yield
    finally:
        ray.shutdown()


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

