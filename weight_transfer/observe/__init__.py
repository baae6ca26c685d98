"""Observability: metrics, the Prometheus exporter, Chrome traces and timelines."""
