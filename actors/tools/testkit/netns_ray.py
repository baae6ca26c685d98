"""A Ray cluster whose nodes run in the namespaces of a
:class:`~actors.tools.testkit.netns.NetnsNetwork`.

One ``ray start --block`` per site, each in its namespace, bound to the site's
address (``--node-ip-address``): the head in one site, a worker node in every
other, each with the custom resources it is given (``ns_<label>`` always, so
actors can be placed by site; ``node_<k>``/``inode_<k>`` to pin the cluster
config's trainer nodes and replicas, :mod:`actors.placement`). Ray's token
reaches every process through ``RAY_AUTH_TOKEN_PATH`` in the environment, the
project through ``PYTHONPATH``; each node keeps its files in a temporary
directory of its own (so this cluster's address file never becomes the
machine's "last cluster"). A driver runs in the head's site (Ray connects a
driver to a node of its own host; the head's namespace is that host)::

    with NetnsNetwork(["trainers", "engines"]) as net, NetnsRay(net, head="trainers",
            resources={"trainers": {"node_0": 4}, "engines": {"inode_0": 4}}) as cluster:
        out = cluster.run_driver([sys.executable, "-m", "actors.tools.cli.main", "demo", ...])

:meth:`NetnsRay.close` ends every node (SIGTERM to its process group, SIGKILL
after a grace period) and then every process left in the namespaces.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from actors.tools.ray_token import token_path
from actors.tools.testkit.netns import NetnsError, NetnsNetwork

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]  # the source tree: its modules go on PYTHONPATH
GCS_PORT = 6379  # each site has its own port space
STOP_WAIT_S = 5.0
OBJECT_STORE_BYTES = 256 << 20  # each node; the tests move digests, not weights
_WAIT_NODES = """
import json, sys, time, ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
want, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({n["NodeManagerAddress"]: n["Resources"] for n in alive}))
"""


def site_resource(label: str) -> str:
    """The custom resource that names site ``label`` (``ns_trainers``)."""
    return f"ns_{label}"


class NetnsRay:
    """Ray nodes in the sites of ``net``; see the module docstring. A context manager."""

    def __init__(self, net: NetnsNetwork, *, head: str,
                 resources: Mapping[str, Mapping[str, float]], num_cpus: int = 8,
                 start_timeout_s: float = 180.0) -> None:
        unknown = sorted(set(resources) - set(net.sites))
        if unknown or head not in net.sites:
            raise ValueError(f"NetnsRay: sites {unknown or [head]} are not sites of the "
                             f"network ({sorted(net.sites)})")
        self.net, self.head, self.num_cpus = net, head, num_cpus
        self.labels = [head, *[s for s in resources if s != head]]
        self.resources = {s: {site_resource(s): 100.0, **resources.get(s, {})}
                          for s in self.labels}
        self.start_timeout_s = start_timeout_s
        self.address = f"{net.addr(head)}:{GCS_PORT}"
        self._procs: dict[str, subprocess.Popen] = {}
        self._tmp: Path | None = None
        self.nodes: dict[str, dict] = {}

    def __enter__(self) -> NetnsRay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def temp_dir(self) -> Path | None:
        """The nodes' files (sessions, sockets, logs) while the cluster runs."""
        return self._tmp

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every process in the sites: Ray's token, the project, the
        cluster's address; no proxy, no inherited Ray address."""
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "USER")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path()),
                   RAY_ADDRESS=self.address,
                   PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0",
                   PYTHONUNBUFFERED="1",
                   # Ray's memory monitor counts the whole machine's memory: on a shared
                   # test host other jobs' memory would make it kill this cluster's workers.
                   RAY_memory_monitor_refresh_ms="0", **extra)
        return env

    def _ray_argv(self, label: str) -> list[str]:
        assert self._tmp is not None
        ray_bin = str(Path(sys.executable).with_name("ray"))
        tmp = self._tmp / label[:8]
        argv = [ray_bin, "start", "--block", "--disable-usage-stats",
                f"--node-ip-address={self.net.addr(label)}", f"--num-cpus={self.num_cpus}",
                f"--resources={json.dumps(self.resources[label])}", f"--temp-dir={tmp}",
                f"--object-store-memory={OBJECT_STORE_BYTES}"]
        if label == self.head:
            return [*argv, "--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        return [*argv, f"--address={self.address}"]

    def start(self) -> None:
        """Start the head, then every worker node; wait until all are alive (closed again
        when that fails)."""
        self._tmp = Path(tempfile.mkdtemp(prefix=f"wtr{os.getpid()}", dir="/tmp"))
        try:
            for label in self.labels:
                self._start_node(label)
                if label == self.head:
                    time.sleep(2.0)  # let the GCS come up before the workers dial it
            self.nodes = self._wait_nodes()
        except BaseException:
            self.close()
            raise
        log.info("Ray nodes up in sites %s (head %s)", self.labels, self.address)

    def _start_node(self, label: str) -> None:
        log_path = self._tmp / f"{label}.log"
        with open(log_path, "w") as out:
            self._procs[label] = self.net.popen(label, self._ray_argv(label), env=self.env(),
                                                stdout=out, stderr=subprocess.STDOUT,
                                                cwd=str(ROOT))

    def _wait_nodes(self) -> dict[str, dict]:
        out = self.net.run(self.head, [sys.executable, "-c", _WAIT_NODES,
                                       str(len(self.labels)), str(self.start_timeout_s)],
                           env=self.env(), timeout=self.start_timeout_s + 60, check=False)
        dead = {s: p.returncode for s, p in self._procs.items() if p.poll() is not None}
        nodes = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
        if out.returncode != 0 or dead or len(nodes) < len(self.labels):
            raise NetnsError(f"Ray nodes in sites {self.labels}: {len(nodes)} alive, exited "
                             f"{dead}; {out.stderr.strip()[-1500:]} {self.logs()}")
        return nodes

    def logs(self, tail: int = 1500) -> str:
        """The end of every node's ``ray start`` output (for error messages)."""
        if self._tmp is None:
            return ""
        return " ".join(f"[{p.stem}] {p.read_text(errors='replace')[-tail:]}"
                        for p in sorted(self._tmp.glob("*.log")))

    def run_driver(self, argv: Sequence[str], *, timeout: float = 600.0,
                   env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` as a Ray driver in the head's site (not checked: see returncode)."""
        return self.net.run(self.head, argv, env=self.env(**dict(env or {})), timeout=timeout,
                            check=False)

    def close(self) -> None:
        """End every node (its process group), then whatever is left in the namespaces;
        remove the nodes' directories. Idempotent."""
        for proc in self._procs.values():
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        for label, proc in self._procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.info("Ray node in %s did not stop on SIGTERM; killing it", label)
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        self._procs.clear()
        self.net.kill_all()  # workers Ray started in a session of their own
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
