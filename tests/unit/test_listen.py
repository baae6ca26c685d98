"""Listeners of ours bind one address, never a wildcard (weight_transfer.sync.listen)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import prometheus_client
import pytest

from actors.groups import host_store
from weight_transfer.observe.prometheus import MetricsListen, serve_metrics
from weight_transfer.sync.listen import check_listen_address, is_wildcard, serve_store


@pytest.mark.parametrize("address", ["", "0.0.0.0", "::", "[::]", "*", "0:0:0:0:0:0:0:0"])
def test_wildcards_are_refused_naming_the_listener(address):
    assert is_wildcard(address)
    with pytest.raises(ValueError, match=r"barrier store: refusing to listen on .*wildcard"):
        check_listen_address(address, what="barrier store")


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2", "10.1.2.3", "::1", "node-7"])
def test_one_address_is_accepted(address):
    assert check_listen_address(address, what="x") == address


def test_a_store_on_a_wildcard_is_refused():
    with pytest.raises(ValueError, match=r"store: refusing to listen on '0\.0\.0\.0'"):
        host_store(host="0.0.0.0")


def test_the_metrics_exporter_binds_loopback_by_default_and_serves_our_metrics():
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("wt_test_total", "t", registry=registry).inc(3)
    with serve_metrics(registry=registry) as exporter:
        assert exporter.host == "127.0.0.1" and exporter.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as r:
            assert "wt_test_total 3.0" in r.read().decode()


def test_the_metrics_exporter_refuses_a_wildcard():
    with pytest.raises(ValueError, match=r"MetricsListen\.address.*wildcard"):
        serve_metrics(MetricsListen(address="0.0.0.0"))


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc prints them) listening on ``port`` here."""
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
                out.append(fields[1].split(":")[0])
    return out


def test_a_served_store_listens_on_its_host_only():
    store = serve_store("127.0.0.1", timeout_s=10)
    assert _listening(store.port) == ["0100007F"]  # 127.0.0.1, not [::] (torch's own bind)
