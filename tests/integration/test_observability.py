"""Metrics, traces and progress of real updates on a local Ray instance (tiny_llama,
2 FSDP2 trainer actors -> 2 replicas x TP2 over simnic).

Inside Ray the facade records through ``ray.util.metrics`` (the ``auto``
backend). The values recorded through the facade are checked in the
controller's process and in a trainer's; then Ray's metrics agent, started
with an export port on loopback, is scraped (127.0.0.2 only, a bounded wait)
and must show the same numbers in the Prometheus text format.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import ray
import torch

from actors import (
    TransferConfig,
    UpdateError,
    WeightTransferController,
    launch_engines,
    launch_trainers,
)
from actors.tools.demo.fleet import LOCAL_NODE_IP
from actors.tools.testkit.hooks import FaultyTrainerActor
from weight_transfer.observe.trace import read_chrome_trace, timeline_of_trace

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL_NODE_IP, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(cluster_file):
    port = _free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _node_ip_address=LOCAL_NODE_IP, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 500})
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    cluster_file(trainers=2, replicas=2, tp=2),
                                    update_timeout_s=120, barrier_timeout_s=60)
    trainers = launch_trainers(cfg, actor_cls=FaultyTrainerActor)  # wt_set_link
    replicas = launch_engines(cfg)
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    calls = []
    ctl.progress = lambda phase, done, total: calls.append((phase, done, total))
    ctl.setup()
    yield ctl, trainers, calls, port
    ray.shutdown()


def _train(trainers, step):
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(step))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])


def _trainer_snapshot(trainer):
    return ray.get(trainer.__ray_call__.remote(
        lambda self: self._wt_link.transfer.metrics.snapshot()))


def test_setup_reports_progress_of_every_wait(env):
    _, _, calls, _ = env
    phases = list(dict.fromkeys(p for p, _, _ in calls))
    assert phases[:2] == ["gather trainer metadata", "gather engine metadata"]
    assert "compute the plan" in phases and "distribute the plan" in phases
    for phase in phases:
        counts = [(d, t) for p, d, t in calls if p == phase]
        assert counts[0][0] == 0 and counts[-1][0] == counts[-1][1]  # from 0 to all done
    assert ("gather trainer metadata", 2, 2) in calls


def test_a_traced_update_brings_spans_back_and_a_plain_one_does_not(env, tmp_path):
    ctl, trainers, _, _ = env
    _train(trainers, 1)
    path = tmp_path / "v1.json"
    traced = ctl.update(1, trace=path)
    assert traced.trace is not None and all(r.trace is not None for r in traced.per_rank)
    _train(trainers, 2)
    plain = ctl.update(2)
    assert plain.trace is None and all(r.trace is None for r in plain.per_rank)
    doc = read_chrome_trace(path)
    procs = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert procs == {"controller", *(f"trainer rank {r} (tnode0/nic{r})" for r in range(2))}
    tl = timeline_of_trace(doc)
    assert tl.rows == ("rank 0", "rank 1")
    assert {"prepare", "write", "nic", "barrier"} <= {b.stage for b in tl.bars}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] > 0]
    assert sum(e["args"]["bytes"] for e in spans if e["cat"] == "nic") == traced.bytes
    bound = doc["otherData"]["updates"][0]["nic_bound_s"]  # the plan's busiest NIC at line rate
    summary, cluster = ctl.summary, ctl.config.cluster
    assert bound == max(max(summary.send_nic_bytes.values()) / cluster.send_bytes_per_s,
                        max(summary.recv_nic_bytes.values()) / cluster.recv_bytes_per_s) > 0
    # Each rank's spans lie within the controller's update (clocks aligned to wall time).
    assert all(-1e-3 <= b.start <= b.end <= traced.seconds + 1e-3 for b in tl.bars)


def test_failures_by_kind_then_recovery_are_counted(env):
    ctl, trainers, _, _ = env
    ray.get(trainers[1].wt_set_link.remote(False))
    ctl.auto_resync = False  # keep the torn replicas torn: their gauge says -1
    try:
        with pytest.raises(UpdateError):
            ctl.update(3)
    finally:
        ray.get(trainers[1].wt_set_link.remote(True))
        ctl.auto_resync = True
    torn = ctl.summary.replicas_by_rank[1]
    snap = ctl.metrics.snapshot()
    assert snap["wt_update_failures"][(("kind", "writes_failed"),)] == 1
    assert snap["wt_update_failures"][(("kind", "torn_replica"),)] == len(torn)
    assert all(snap["wt_replica_version"][(("replica", r),)] == -1 for r in torn)
    rank1 = _trainer_snapshot(trainers[1])["wt_update_failures"]
    # Per failed WRITE, by the fault's class (link down: retried, then given up).
    assert rank1[(("kind", "LinkDownError"),)] > 0
    _train(trainers, 4)
    ctl.update(4)
    snap = ctl.metrics.snapshot()
    assert {labels: v for labels, v in snap["wt_replica_version"].items()} == {
        (("replica", "engine0"),): 4, (("replica", "engine1"),): 4}


def _scrape(port: int) -> str:
    url = f"http://{LOCAL_NODE_IP}:{port}/metrics"
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()
    return ""


def _value(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Ray adds its own)."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.fullmatch(r"([\w:]+)\{(.*)\} (\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            total, found = total + float(m.group(3)), True
    return total if found else None


def test_the_values_are_recorded_through_the_facade_and_exported_by_ray(env):
    ctl, trainers, _, port = env
    assert ctl.metrics.backend_name == "ray"
    snap = ctl.metrics.snapshot()
    count, _ = snap["wt_update_seconds"][()]
    nbytes = snap["wt_update_bytes"][()]
    assert count == 3 and nbytes == 3 * ctl.summary.bytes_total  # updates 1, 2 and 4
    rank0 = _trainer_snapshot(trainers[0])
    sent = rank0["wt_nic_bytes"][(("nic", "tnode0/nic0"), ("rank", "0"))]
    assert sent == 4 * ctl.summary.bytes_by_rank[0]  # rank 0 also wrote all of failed v3
    assert rank0["wt_nic_throughput_gbps"][(("nic", "tnode0/nic0"), ("rank", "0"))] > 0
    assert rank0["wt_watermark_bytes"][(("rank", "0"),)] == 0  # all given back after a run

    want = {("ray_wt_update_seconds_count", ()): count,
            ("ray_wt_update_bytes_total", ()): nbytes,
            ("ray_wt_replica_version", (("replica", "engine0"),)): 4,
            ("ray_wt_update_failures_total", (("kind", "writes_failed"),)): 1,
            ("ray_wt_nic_bytes_total", (("nic", "tnode0/nic0"),)): sent,
            ("ray_wt_watermark_bytes", (("rank", "0"),)): 0}
    deadline, text, got = time.monotonic() + 60, "", {}
    while time.monotonic() < deadline:
        text = _scrape(port)
        got = {k: _value(text, k[0], **dict(k[1])) for k in want}
        if got == want:
            break
        time.sleep(1)
    if not text:
        pytest.skip(f"Ray's metrics agent did not answer on {LOCAL_NODE_IP}:{port} within 60 s")
    assert got == want, text[-3000:]
