"""Metrics without Ray: the facade over prometheus_client, fed by a real transfer.

A plan is replayed through ``RankTransfer`` into simnic regions (as in
test_executor.py) with a facade over a private ``CollectorRegistry``; the
values must then be in ``prometheus_client.generate_latest`` - the text a
Prometheus server scrapes. The controller's part (update seconds, bytes,
failures by kind, replica versions) is fed from its report functions.
"""

from __future__ import annotations

import asyncio
import re

import prometheus_client
import pytest
from test_executor import Setup

from actors.controller.audit import failure_kinds, record_failure, record_success
from actors.reports import (
    RankReport,
    TrainerFault,
    UpdateReport,
    WriteFailure,
    rank_report_of,
)
from weight_transfer.errors import FaultKind
from weight_transfer.observe.metrics import (
    METRICS,
    backend_names,
    make_backend,
    make_metrics,
    register_backend,
)


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample line of the exposition text."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if got == labels:
            return float(m.group(3))
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


@pytest.fixture
def registry():
    return prometheus_client.CollectorRegistry()


def test_a_real_transfer_shows_up_in_the_prometheus_exposition(registry):
    metrics = make_metrics("prometheus", registry=registry)
    s = Setup("tiny_llama", fp8=False)
    try:
        engine = s.engines[0]
        revoked = engine.tensors[0].region
        s.targets[revoked.nic].deregister(revoked)  # some writes fail: counted by kind
        lost = [t for t in s.plan.trainer_plan(0).tasks if t.region == revoked]
        transfer = s.transfer(0, watermark_bytes=1 << 20, metrics=metrics,
                              on_write_error=lambda task, exc: None)
        rep = asyncio.run(transfer.run(version=1))
        transfer.close()
    finally:
        s.close()
    text = prometheus_client.generate_latest(registry).decode()
    assert sample(text, "wt_nic_bytes_total", nic="trainer-nic", rank="0") == rep.bytes_written
    gbps = sample(text, "wt_nic_throughput_gbps", nic="trainer-nic", rank="0")
    assert gbps == pytest.approx(rep.bytes_written / rep.seconds / 1e9)
    assert sample(text, "wt_update_failures_total", kind="RemoteAccessError") == len(lost) > 0
    # Every reservation is given back: the gauge ends at 0, after a peak above it.
    assert sample(text, "wt_watermark_bytes", rank="0") == 0
    assert rep.watermark_peak > 0

    # The controller's part, from a report as update() builds it.
    report = UpdateReport.combine(version=1, seconds=0.25,
                                  per_rank=[rank_report_of(rep)], replicas=("engine0",))
    record_success(metrics, report, {"engine0": 1, "engine1": 1})
    record_failure(metrics, {0: _fault(0, FaultKind.TIMEOUT, "did not finish within 5 s")},
                   {}, ["engine1"],
                   {"engine0": 1, "engine1": None})
    text = prometheus_client.generate_latest(registry).decode()
    assert sample(text, "wt_update_seconds_count") == 1
    assert sample(text, "wt_update_seconds_sum") == 0.25
    assert sample(text, "wt_update_seconds_bucket", le="0.3") == 1
    assert sample(text, "wt_update_bytes_total") == rep.bytes_written
    assert sample(text, "wt_replica_version", replica="engine0") == 1
    assert sample(text, "wt_replica_version", replica="engine1") == -1  # torn
    assert sample(text, "wt_update_failures_total", kind="timeout") == 1
    assert sample(text, "wt_update_failures_total", kind="torn_replica") == 1
    snap = metrics.snapshot()
    assert snap["wt_update_seconds"][()] == (1, 0.25)
    assert snap["wt_replica_version"][(("replica", "engine1"),)] == -1


def _report(rank: int, failures=()) -> RankReport:
    from weight_transfer.sender.executor import TransferReport

    t = TransferReport(rank=rank, version=1, seconds=1.0, bytes_written=1, bytes_planned=1,
                       writes=1, params_gathered=1, barrier_seconds=0.0, watermark_peak=0,
                       spans=())
    return RankReport(transfer=t, failures=tuple(failures))


def _fault(rank: int, kind: FaultKind, error: str) -> TrainerFault:
    return TrainerFault(rank=rank, kind=kind, error=error)


FAIL = WriteFailure(replica="engine0", owner="engine0/tp0", count=2, nbytes=8,
                    error="PeerUnreachableError: link down")


@pytest.mark.parametrize("errors,reports,torn,want", [
    ({}, {}, [], {}),
    ({1: _fault(1, FaultKind.TIMEOUT, "did not finish within 120 s")}, {}, [], {"timeout": 1}),
    ({0: _fault(0, FaultKind.FAILED, "RuntimeError: boom"),
      1: _fault(1, FaultKind.ABORTED, "did not finish: another rank failed")}, {}, ["e0"],
     {"rank_error": 1, "torn_replica": 1}),
    ({}, {0: _report(0, [FAIL]), 1: _report(1)}, ["engine0"],
     {"writes_failed": 1, "torn_replica": 1}),
])
def test_failure_kinds(errors, reports, torn, want):
    assert failure_kinds(errors, reports, torn) == want


def test_every_metric_has_a_distinct_name_and_known_kind(registry):
    names = [m[0] for m in METRICS]
    assert len(set(names)) == len(names) and all(n.startswith("wt_") for n in names)
    assert {m[1] for m in METRICS} <= {"counter", "gauge", "histogram"}
    make_metrics("prometheus", registry=registry)
    make_metrics("prometheus", registry=registry)  # instruments are shared, not re-registered


def test_the_registry_is_lazy_and_names_what_it_knows():
    with pytest.raises(ValueError, match=r"unknown metrics backend 'nope'.*prometheus"):
        make_backend("nope")
    register_backend("test-null", "weight_transfer.observe.metrics", "NullBackend")
    assert "test-null" in backend_names()
    m = make_metrics("test-null")
    m.failure("x", 2)
    m.failure("x")
    assert m.snapshot()["wt_update_failures"] == {(("kind", "x"),): 3}
