"""The ``tcp`` listener under a connection flood, on 127.0.0.1: a flood cannot starve it.

The flood comes from outsiders of their own (``tests/outsider/churn.py``: plain
Python, raw sockets, no key, nothing of the project): three processes opening
connection after connection to the target port (each saying nothing, random bytes
or half a hello), closing each at once or keeping their last 32 open (96 in all,
more than the target's ``max_pending``, so it must push connections out). While
they churn, every planned writer connects (setup's connect, tried again with
jittered backoff within ``connect_timeout_s``) and its write lands byte-exact; the
target's thread count does not grow with the flood (handshakes run on one selector
thread); every refusal is counted and the log holds one line for the flooding host.

Also, each exact: the oldest connection in its handshake is the one pushed out;
refusals are counted one by one and logged once per remote host per interval (the
next line says how many were not logged); a writer whose target starts listening
late connects once it does. Outcomes are asserted, never times (timeouts are
generous: a loaded machine stretches any).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import numpy as np
import pytest
from outsider.driver import Churn  # tests/ is on sys.path (its conftest.py)

import weight_transfer.transport.tcp.transport as tcp_transport
from weight_transfer.observe.throttle import LogThrottle
from weight_transfer.transport import make_transport
from weight_transfer.transport.tcp.client import MAX_BACKOFF_S, connect_backoff_s
from weight_transfer.types import PeerInfo

HOST = "127.0.0.1"
N = 4096
WRITERS = 3
TARGET_LOG = "weight_transfer.transport.tcp.target"


def until(cond, what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``cond`` (a deadline for a hang, not a timed assert)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


class Target:
    """One target NIC with a region per planned writer ``trainer<i>/w0``."""

    def __init__(self, writers: int = WRITERS, **options) -> None:
        self.nic = make_transport("tcp", owner="engine0/tp0", nic="t0", host=HOST, **options)
        self.mems = [np.zeros(N, np.uint8) for _ in range(writers)]
        self.regions = [self.nic.register(m) for m in self.mems]
        self.infos = []
        for i, region in enumerate(self.regions):
            self.nic.grant(f"trainer{i}", "w0", [region.addr])
            self.infos.append(self.nic.peer_info(f"trainer{i}", "w0"))
        self.port = self.infos[0].endpoint["port"]
        self.nic.open_window()

    def close(self) -> None:
        self.nic.close()


def connect_and_write(info: PeerInfo, region, i: int, out: dict) -> None:
    """Writer ``trainer<i>/w0``: connect (as setup does), write ``i + 1`` into its region."""
    w = make_transport("tcp", owner=f"trainer{i}", nic="w0", host=HOST, connect_timeout_s=120)
    start = time.monotonic()
    try:
        w.connect(info)
        out[i] = time.monotonic() - start
        asyncio.run(w.write(np.full(N, i + 1, np.uint8), region, 0))
    except Exception as exc:
        out[i] = exc
    finally:
        w.close()


def sample_threads(stop: threading.Event, seen: list[int]) -> None:
    while not stop.is_set():
        seen.append(threading.active_count() - 1)  # not this sampler
        time.sleep(0.005)


@pytest.mark.slow  # three outsider processes, a few seconds of flood
@pytest.mark.parametrize("hold", [0, 32], ids=["close-at-once", "hold-32-each"])
def test_a_churning_flood_leaves_every_planned_writer_connected(hold, caplog):
    caplog.set_level(logging.WARNING, logger=TARGET_LOG)
    t = Target()  # the defaults: handshake_timeout_s 2, max_pending 64
    idle_threads = threading.active_count()
    flood = Churn(HOST, t.port, processes=3, hold=hold)
    try:
        until(lambda: t.nic.refused_connections >= 200, "the flood was refused")
        stop, seen = threading.Event(), []
        sampler = threading.Thread(target=sample_threads, args=(stop, seen))
        sampler.start()
        time.sleep(0.5)  # the flood alone: no thread per connection
        stop.set()
        sampler.join()
        results: dict[int, object] = {}
        writers = [threading.Thread(target=connect_and_write, args=(info, region, i, results))
                   for i, (info, region) in enumerate(zip(t.infos, t.regions, strict=True))]
        for w in writers:
            w.start()
        for w in writers:
            w.join(300)
        assert flood.running()  # the writers connected while it churned
    finally:
        counts = flood.stop()
        t.close()
    assert all(isinstance(results.get(i), float) for i in range(WRITERS)), results
    assert all((m == i + 1).all() for i, m in enumerate(t.mems))
    # no thread per connection: never more threads than before the flood (fewer where a
    # thread an earlier test in this process left ended meanwhile)
    assert max(seen) <= idle_threads, (idle_threads, sorted(set(seen)))
    assert sum(c["connections"] for c in counts) >= t.nic.refused_connections >= 200
    lines = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # one flooding host: one line
    print(f"\nflood ({hold=}): {counts}; refused {t.nic.refused_connections}; writers "
          f"connected after {[round(results[i], 3) for i in range(WRITERS)]} s")


def test_the_oldest_connection_in_its_handshake_is_pushed_out_first():
    t = Target(writers=1, handshake_timeout_s=60.0, max_pending=4)
    gate = t.nic._listener.gate
    socks = []
    try:
        for k in range(4):  # c0 .. c3, each in its handshake (c1: half a hello)
            socks.append(socket.create_connection((HOST, t.port), timeout=30))
            if k == 1:
                socks[-1].sendall(b"WTT1")
            until(lambda k=k: gate.pending == k + 1, f"connection {k} accepted")
        socks.append(socket.create_connection((HOST, t.port), timeout=30))  # c4: one too many
        assert socks[0].recv(1) == b""  # c0, the oldest, closed
        until(lambda: gate.pending == 4, "c4 accepted")
        for sock in socks[1:]:  # c1 .. c4 still wait for their handshake
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        assert t.nic.refused_connections == 1
        assert t.nic.refusals()[-1].reason.startswith("pushed out by newer connections")
        host, port = socks[0].getsockname()
        assert t.nic.refusals()[-1].peer == f"{host}:{port}"
    finally:
        for sock in socks:
            sock.close()
        t.close()


def test_refusals_are_each_counted_and_logged_once_per_host(caplog):
    caplog.set_level(logging.WARNING, logger=TARGET_LOG)
    t = Target(writers=1)
    try:
        for source, n in (("127.0.0.1", 40), ("127.0.0.2", 5)):
            for _ in range(n):  # connect and close at once, from ``source``
                socket.create_connection((HOST, t.port), source_address=(source, 0)).close()
        until(lambda: t.nic.refused_connections == 45, "45 refusals counted")
    finally:
        t.close()
    lines = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "from 127.0.0.1:" in lines[0] and "from 127.0.0.2:" in lines[1]
    assert all("closed by the peer before finishing the handshake" in m for m in lines)
    assert all("refused_connections" in m for m in lines)


def test_a_throttled_source_is_logged_again_after_the_interval_with_its_count():
    now = [0.0]
    throttle = LogThrottle(every_s=60.0, max_sources=2, clock=lambda: now[0])
    assert throttle.due("a") == 0 and throttle.due("b") == 0
    assert [throttle.due("a") for _ in range(5)] == [None] * 5
    now[0] = 61.0
    assert throttle.due("a") == 5  # logged again: 5 were not
    assert throttle.due("a") is None
    assert throttle.due("c") == 0  # a third source: "b" (least recently logged) forgotten
    assert throttle.due("b") == 0
    with pytest.raises(ValueError, match="every_s"):
        LogThrottle(every_s=-1)


def test_connect_tries_again_until_the_target_listens(monkeypatch):
    key = bytes(range(32))
    monkeypatch.setattr(tcp_transport, "new_link_key", lambda: key)
    probe = socket.create_server((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens on ``port`` now
    info = PeerInfo(owner="engine0/tp0", nic="t0", transport="tcp",
                    endpoint={"host": HOST, "port": port, "key": key.hex(), "encrypt": None,
                              "compression": "none", "chunk_bytes": 4 << 20})
    w = make_transport("tcp", owner="trainer0", nic="w0", host=HOST, connect_timeout_s=120)
    errors: list[Exception] = []

    def connect() -> None:
        try:
            w.connect(info)
        except Exception as exc:
            errors.append(exc)

    writer, late = threading.Thread(target=connect), None
    try:
        writer.start()
        time.sleep(0.5)  # the writer's first tries are refused
        assert writer.is_alive()
        late = Target(writers=1, port=port)  # its key for trainer0/w0 is ``key``
        writer.join(300)
        assert not writer.is_alive() and not errors, errors
        asyncio.run(w.write(np.full(N, 5, np.uint8), late.regions[0], 0))
        assert (late.mems[0] == 5).all()
    finally:
        w.close()
        if late is not None:
            late.close()


def test_connect_backoff_is_jittered_and_capped():
    draws = [connect_backoff_s(a) for a in range(12) for _ in range(20)]
    assert all(0.0 <= d <= MAX_BACKOFF_S for d in draws)
    assert len(set(draws)) == len(draws)  # jittered: no two equal
    assert max(connect_backoff_s(0) for _ in range(200)) <= 0.02
    assert max(connect_backoff_s(30) for _ in range(200)) > 0.5  # grows to the cap
