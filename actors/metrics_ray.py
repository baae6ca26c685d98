"""The ``ray`` metrics backend (``ray.util.metrics``) and how actors pick a backend.

Inside Ray, every process records through ``ray.util.metrics``; Ray's metrics
agent on each node exports them in the Prometheus format (names prefixed
``ray_``, e.g. ``ray_wt_update_seconds``) at the node's metrics export port.
Importing this module registers the backend with :mod:`weight_transfer.observe.metrics`::

    metrics = actor_metrics(config.metrics)   # "auto": ray inside Ray, else prometheus
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util import metrics as ray_metrics

from weight_transfer.observe.metrics import TransferMetrics, make_metrics, register_backend

_KINDS = {
    "counter": ray_metrics.Counter,
    "gauge": ray_metrics.Gauge,
    "histogram": ray_metrics.Histogram,
}


class RayBackend:
    """Instruments of ``ray.util.metrics`` (one per metric name in this process)."""

    _made: dict[str, Any] = {}

    def instrument(self, name: str, kind: str, description: str, labels: Sequence[str],
                   buckets: Sequence[float]) -> _RayInstrument:
        if kind not in _KINDS:
            raise ValueError(f"metric {name}: unknown kind {kind!r}; expected {sorted(_KINDS)}")
        if name not in self._made:
            extra = {"boundaries": list(buckets)} if kind == "histogram" else {}
            self._made[name] = _KINDS[kind](name, description=description,
                                            tag_keys=tuple(labels), **extra)
        return _RayInstrument(self._made[name], kind)


class _RayInstrument:
    def __init__(self, metric: Any, kind: str) -> None:
        self.metric, self.kind = metric, kind

    def record(self, value: float, labels: Mapping[str, str]) -> None:
        tags = dict(labels) or None
        if self.kind == "counter":
            if value > 0:  # Ray counters refuse zero increments
                self.metric.inc(value, tags=tags)
        elif self.kind == "gauge":
            self.metric.set(value, tags=tags)
        else:
            self.metric.observe(value, tags=tags)


register_backend("ray", __name__, "RayBackend")


def resolve_backend(name: str) -> str:
    """``auto`` is ``ray`` in a process connected to Ray, else ``prometheus``."""
    if name == "auto":
        return "ray" if ray.is_initialized() else "prometheus"
    return name


def actor_metrics(name: str) -> TransferMetrics:
    return make_metrics(resolve_backend(name))
