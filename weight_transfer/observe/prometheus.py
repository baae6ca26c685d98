"""The ``prometheus`` metrics backend: ``prometheus_client`` instruments in one registry.

Used when the library runs without Ray; expose the registry with
:func:`serve_metrics` (an HTTP exporter on the address given, loopback by
default, never a wildcard: prometheus_client's own default is ``0.0.0.0``) or
read it with ``prometheus_client.generate_latest(registry)``::

    registry = prometheus_client.CollectorRegistry()
    m = make_metrics("prometheus", registry=registry)
    exporter = serve_metrics(MetricsListen(address=node_ip, port=9100), registry=registry)
    ...
    exporter.close()

Instruments are made once per registry and reused, so several facades over the
same registry (the default one, for instance) share them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import prometheus_client

from weight_transfer.sync.listen import check_listen_address

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


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsListen:
    """Where the exporter listens: ``address`` (loopback by default, or the node address
    a scraper reaches; a wildcard is refused) and ``port`` (0: a free one)."""

    address: str = "127.0.0.1"
    port: int = 0


class MetricsExporter:
    """A running HTTP exporter (``host``, ``port``); ``close()`` stops it."""

    def __init__(self, server: Any, thread: Any) -> None:
        self._server, self._thread = server, thread
        self.host, self.port = server.server_address[:2]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(listen: MetricsListen = MetricsListen(), *,
                  registry: prometheus_client.CollectorRegistry | None = None
                  ) -> MetricsExporter:
    """Serve ``registry`` (default: the global one) over HTTP on ``listen`` only."""
    host = check_listen_address(listen.address, what="metrics exporter (MetricsListen.address)")
    if not isinstance(listen.port, int) or not 0 <= listen.port < 65536:
        raise ValueError(f"metrics exporter: port must be an integer in [0, 65536), not "
                         f"{listen.port!r}")
    server, thread = prometheus_client.start_http_server(
        listen.port, addr=host, registry=prometheus_client.REGISTRY if registry is None
        else registry)
    return MetricsExporter(server, thread)
