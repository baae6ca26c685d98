"""The ``prometheus`` metrics backend: ``prometheus_client`` instruments in one registry.

Used when the library runs without Ray; expose the registry with
``prometheus_client.start_http_server(port)`` or read it with
``prometheus_client.generate_latest(registry)``::

    registry = prometheus_client.CollectorRegistry()
    m = make_metrics("prometheus", registry=registry)
    ...
    print(prometheus_client.generate_latest(registry).decode())

Instruments are made once per registry and reused, so several facades over the
same registry (the default one, for instance) share them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import prometheus_client

_KINDS = {
    "counter": prometheus_client.Counter,
    "gauge": prometheus_client.Gauge,
    "histogram": prometheus_client.Histogram,
}
_LOCK = threading.Lock()
_MADE: dict[tuple[int, str], Any] = {}  # (id(registry), name) -> prometheus instrument


class PrometheusBackend:
    """Instruments registered in ``registry`` (default: prometheus_client's global one)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry | None = None) -> None:
        self.registry = prometheus_client.REGISTRY if registry is None else registry

    def instrument(self, name: str, kind: str, description: str, labels: Sequence[str],
                   buckets: Sequence[float]) -> _PromInstrument:
        if kind not in _KINDS:
            raise ValueError(f"metric {name}: unknown kind {kind!r}; expected {sorted(_KINDS)}")
        with _LOCK:
            key = (id(self.registry), name)
            if key not in _MADE:
                extra = {"buckets": tuple(buckets)} if kind == "histogram" else {}
                _MADE[key] = _KINDS[kind](name, description, labelnames=tuple(labels),
                                          registry=self.registry, **extra)
            return _PromInstrument(_MADE[key], kind)


class _PromInstrument:
    def __init__(self, metric: Any, kind: str) -> None:
        self.metric, self.kind = metric, kind

    def record(self, value: float, labels: Mapping[str, str]) -> None:
        target = self.metric.labels(**labels) if labels else self.metric
        if self.kind == "counter":
            target.inc(value)
        elif self.kind == "gauge":
            target.set(value)
        else:
            target.observe(value)
