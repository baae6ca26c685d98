"""Metrics of weight updates: one facade, backends chosen at run time through a lazy registry.

:class:`TransferMetrics` names the metrics once and records them through a
backend; the backend is picked by name when the facade is made::

    m = make_metrics("prometheus")               # prometheus_client, its default registry
    m.update_done(seconds=1.2, nbytes=10 << 30)   # wt_update_seconds, wt_update_bytes
    m.failure("PeerUnreachableError")             # wt_update_failures{kind}
    m.watermark_in_use(rank=3, nbytes=1 << 28)    # wt_watermark_bytes{rank}
    m.nic_transfer(nic="tnode0/nic1", rank=3, nbytes=n, seconds=s)  # wt_nic_* {nic, rank}
    m.replica_version("engine0", 7)               # wt_replica_version{replica}; -1 = torn/none
    m.integrity_mismatches("engine0", 1, check="tick")  # wt_integrity_mismatches{replica, check}
    m.snapshot()                                  # what this process recorded, for tests

Backends: ``prometheus`` (:mod:`weight_transfer.observe.prometheus`, the
library used without Ray: export with ``prometheus_client.start_http_server`` or
``generate_latest``), ``null`` (records only the snapshot), and ``ray``
(``ray.util.metrics``, exported by Ray's metrics agent), which the ``actors``
package registers (:mod:`actors.metrics_ray`): this core never imports Ray.
``register_backend(name, module, attr)`` adds one; its module is imported on
first use.

The snapshot keeps the last value of gauges, the running total of counters and
the count and sum of histograms, per label set, in the recording process.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

# (name, kind, description, label names); names are the Prometheus base names.
UPDATE_SECONDS = "wt_update_seconds"
UPDATE_BYTES = "wt_update_bytes"
UPDATE_FAILURES = "wt_update_failures"
WATERMARK_BYTES = "wt_watermark_bytes"
NIC_BYTES = "wt_nic_bytes"
NIC_GBPS = "wt_nic_throughput_gbps"
REPLICA_VERSION = "wt_replica_version"
INTEGRITY_MISMATCHES = "wt_integrity_mismatches"

METRICS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (UPDATE_SECONDS, "histogram", "Wall time of one weight update (pause, transfer, resume)", ()),
    (UPDATE_BYTES, "counter", "Bytes written into engine memory by completed updates", ()),
    (UPDATE_FAILURES, "counter", "Failed updates and failed writes, by kind", ("kind",)),
    (WATERMARK_BYTES, "gauge", "Temporary bytes held by a trainer rank's pipeline", ("rank",)),
    (NIC_BYTES, "counter", "Bytes a trainer NIC wrote", ("nic", "rank")),
    (NIC_GBPS, "gauge", "GB/s of a trainer NIC over its rank's last transfer", ("nic", "rank")),
    (REPLICA_VERSION, "gauge", "Weights version a replica holds completely (-1: none, torn)",
     ("replica",)),
    (INTEGRITY_MISMATCHES, "counter",
     "Ranges of served memory that differ from the held version's checksums, by check",
     ("replica", "check")),
)
# Update seconds: 10 ms to 10 minutes.
SECONDS_BUCKETS: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 600.0)


class Instrument(Protocol):
    """One metric of a backend; ``labels`` maps each label name to a value."""

    def record(self, value: float, labels: Mapping[str, str]) -> None: ...


class Backend(Protocol):
    """Makes instruments; ``kind`` is ``counter`` (record adds), ``gauge`` (record sets)
    or ``histogram`` (record observes)."""

    def instrument(self, name: str, kind: str, description: str, labels: Sequence[str],
                   buckets: Sequence[float]) -> Instrument: ...


class NullBackend:
    """Records nothing outside the facade's snapshot."""

    def instrument(self, name: str, kind: str, description: str, labels: Sequence[str],
                   buckets: Sequence[float]) -> Instrument:
        return _NullInstrument()


class _NullInstrument:
    def record(self, value: float, labels: Mapping[str, str]) -> None:
        pass


_BACKENDS: dict[str, tuple[str, str]] = {
    "prometheus": ("weight_transfer.observe.prometheus", "PrometheusBackend"),
    "null": ("weight_transfer.observe.metrics", "NullBackend"),
}


def register_backend(name: str, module: str, attr: str) -> None:
    """Make ``name`` build ``module.attr(**options)``; the module is imported on first use."""
    _BACKENDS[name] = (module, attr)


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def make_backend(name: str, **options: Any) -> Backend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown metrics backend {name!r}; registered: {backend_names()}")
    module, attr = _BACKENDS[name]
    return getattr(importlib.import_module(module), attr)(**options)


class TransferMetrics:
    """The library's metrics over one backend; see the module docstring."""

    def __init__(self, backend: Backend, *, backend_name: str = "") -> None:
        self.backend_name = backend_name or type(backend).__name__
        self._instruments = {
            name: (kind, backend.instrument(name, kind, desc, labels, SECONDS_BUCKETS))
            for name, kind, desc, labels in METRICS
        }
        self._lock = threading.Lock()  # the executor records from worker threads too
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}

    def _record(self, name: str, value: float, **labels: Any) -> None:
        kind, inst = self._instruments[name]
        tags = {k: str(v) for k, v in labels.items()}
        inst.record(float(value), tags)
        key = (name, tuple(sorted(tags.items())))
        with self._lock:
            if kind == "counter":
                self._values[key] = self._values.get(key, 0.0) + value
            elif kind == "gauge":
                self._values[key] = float(value)
            else:
                count, total = self._values.get(key, (0, 0.0))
                self._values[key] = (count + 1, total + value)

    # ------------------------------------------------------------------ what is recorded

    def update_done(self, *, seconds: float, nbytes: int) -> None:
        """One update completed: its wall time and the bytes it wrote."""
        self._record(UPDATE_SECONDS, seconds)
        self._record(UPDATE_BYTES, nbytes)

    def failure(self, kind: str, count: int = 1) -> None:
        """``count`` failures of ``kind`` (an error class, ``timeout``, ``torn_replica``)."""
        self._record(UPDATE_FAILURES, count, kind=kind)

    def watermark_in_use(self, *, rank: int, nbytes: int) -> None:
        self._record(WATERMARK_BYTES, nbytes, rank=rank)

    def nic_transfer(self, *, nic: str, rank: int, nbytes: int, seconds: float) -> None:
        """One rank's transfer through ``nic``: bytes (counter) and GB/s (gauge)."""
        self._record(NIC_BYTES, nbytes, nic=nic, rank=rank)
        gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        self._record(NIC_GBPS, gbps, nic=nic, rank=rank)

    def replica_version(self, replica: str, version: int | None) -> None:
        self._record(REPLICA_VERSION, -1 if version is None else version, replica=replica)

    def integrity_mismatches(self, replica: str, count: int, *, check: str) -> None:
        """``count`` ranges of ``replica``'s served memory differ (``check``: full, tick)."""
        self._record(INTEGRITY_MISMATCHES, count, replica=replica, check=check)

    def snapshot(self) -> dict[str, dict[tuple[tuple[str, str], ...], Any]]:
        """``{metric: {((label, value), ...): value}}`` recorded in this process (histograms:
        ``(count, sum)``)."""
        out: dict[str, dict[tuple[tuple[str, str], ...], Any]] = {}
        with self._lock:
            for (name, labels), value in self._values.items():
                out.setdefault(name, {})[labels] = value
        return out


def make_metrics(backend: str = "prometheus", **options: Any) -> TransferMetrics:
    """The facade over the backend registered as ``backend`` (options go to the backend)."""
    return TransferMetrics(make_backend(backend, **options), backend_name=backend)
