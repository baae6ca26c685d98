"""Our barrier store (``weight_transfer.sync.store``) against outsiders and against its
own key holders, on 127.0.0.1.

The outsider is a process of its own (``tests/outsider/store_client.py``: plain
Python and torch's stock TCPStore client, nothing of the project, no secret) that
knows the store's port. The store runs as the controller runs it: a child process
owned by a :class:`BarrierStore` handle (this test process plays the controller).

- store exhaustion: the outsider's 8 MiB values and 256 MiB of raw bytes are
  refused at the handshake; the store holds nothing, and neither this process nor
  the store's grows;
- a flood of churning connections on the store's port: a barrier crossing still
  passes;
- a key holder (a rank's client) is held to the limits too: a value over 512 B, a
  key outside the setup's namespace and a store over its cap are refused by name,
  and what it holds stays under the cap; a forged arrival written through the store
  is still refused by the barrier (the store key is not the barrier secret);
- the handle's process ends with ``close()``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from outsider.driver import Churn, Outsider  # tests/ is on sys.path (its conftest.py)

from weight_transfer.errors import BarrierRefusedError
from weight_transfer.sync.barrier import BarrierKey, StoreBarrier
from weight_transfer.sync.store import MAX_VALUE_BYTES, BarrierStore, StoreClient
from weight_transfer.sync.store.protocol import (
    ENTRY_BYTES,
    namespace,
    store_identity,
    store_key,
)
from weight_transfer.sync.store.server import StoreServer

HOST = "127.0.0.1"
MIB = 1 << 20


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port``."""
    import psutil

    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(pid).net_connections(kind="tcp"))


def rss(pid: int) -> int:
    """Resident memory of process ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def cross(client_of, key: BarrierKey, tag: str, ranks: int = 2) -> dict[int, object]:
    """Ranks as threads crossing ``tag``: rank -> seconds waited, or the exception."""
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            out[r] = StoreBarrier(client_of(r), rank=r, ranks=range(ranks), key=key,
                                  timeout_s=60).wait(tag)
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.fixture()
def served():
    key = BarrierKey.new()
    with BarrierStore(host=HOST, key=key, timeout_s=30) as store:
        yield key, store


@pytest.mark.slow  # a store process and an outsider process that imports torch
def test_an_outsider_cannot_fill_the_store_nor_grow_the_controller(served):
    key, store = served
    at = {"host": HOST, "port": store.port, "timeout_s": 1}
    assert store.num_keys() == 0  # (its client made before this process is measured)
    # Only the store's process reads what reaches its port: the controller never does, so
    # an outsider cannot grow it (its own RSS moves with whatever else this process does).
    assert listening(store.pid, store.port) and not listening(os.getpid(), store.port)
    with Outsider() as outsider:
        theirs = rss(store.pid)
        assert "error" in outsider.attempt(**at, op="list")
        for i in range(2):  # 8 MiB values under this setup's own namespace
            out = outsider.attempt(**at, op="set", key=f"{key.name}/v1/g0/{i}",
                                   value="x" * (8 * MIB))
            assert "error" in out, out
        blasts = [outsider.attempt(**at, op="blast", bytes=256 * MIB) for _ in range(2)]
    assert all(b["sent"] < 64 * MIB for b in blasts), blasts  # cut off, not swallowed
    assert store.num_keys() == 0
    grew = rss(store.pid) - theirs
    assert grew < 16 * MIB, f"the store's process grew {grew} B"
    print(f"\nblasts {blasts}; the store grew {grew} B")
    assert all(isinstance(v, float) for v in cross(store.client, key, "v1/g0").values())


@pytest.mark.slow  # three outsider processes
def test_a_barrier_crosses_while_the_store_port_is_flooded(served):
    key, store = served
    flood = Churn(HOST, store.port, processes=3, hold=32)
    try:
        results = cross(lambda r: store.client(who=f"rank {r}"), key, "v1/g0", ranks=3)
        assert flood.running()
    finally:
        flood.stop()
    assert all(isinstance(v, float) for v in results.values()), results


@pytest.fixture()
def inproc():
    """The server in this process (to read its counters); a client that holds the key."""
    key = BarrierKey.new()
    server = StoreServer(host=HOST, link_key=store_key(key), namespace=namespace(key),
                         target_id=store_identity(key), max_bytes=64 * 1024)
    client = StoreClient(HOST, server.port, key=key, timeout_s=10)
    yield key, server, client
    client.close()
    server.close()


def test_a_key_holder_is_held_to_the_limits(inproc):
    key, server, client = inproc
    ns = namespace(key)
    client.set(f"{ns}ok", "x" * MAX_VALUE_BYTES)  # the largest value
    with pytest.raises(ValueError, match=r"a value of 513 B .* \(at most 512 B\)"):
        client.set(f"{ns}big", "x" * (MAX_VALUE_BYTES + 1))
    for outside in ("wt-update-guess/v1/g0/1", "other", ns[:-1]):
        with pytest.raises(ValueError, match="outside this setup's namespace"):
            client.set(outside, "1")
    with pytest.raises(ValueError, match="a key of 300 B"):
        client.set(ns + "k" * (300 - len(ns)), "1")
    with pytest.raises(ValueError, match="over its cap of 65536 B"):
        for i in range(1000):  # many keys: the cap ends it
            client.set(f"{ns}many/{i}", "x" * 400)
    assert server.used <= server.max_bytes
    assert server.num_keys() < 1000 and server.refused == 6
    before = server.used
    assert client.delete_key(f"{ns}ok")  # freed bytes can be used again
    assert server.used == before - (ENTRY_BYTES + len(f"{ns}ok") + MAX_VALUE_BYTES)
    client.set(f"{ns}again", "x" * 400)
    assert server.used <= server.max_bytes


def test_a_forged_arrival_through_the_store_is_still_refused(inproc):
    key, server, client = inproc
    client.set(f"{key.name}/v1/g0/1", "0" * 64)  # written by a holder of the store key
    out = cross(lambda r: StoreClient(HOST, server.port, key=key, timeout_s=10), key, "v1/g0")
    refused = [v for v in out.values() if isinstance(v, BarrierRefusedError)]
    assert len(refused) == 2 and {(e.rank, e.tag) for e in refused} == {(1, "v1/g0")}
    assert {e.reason for e in refused} == {"forged", "pre-arrived"}


def test_another_setups_key_is_refused_at_the_handshake(inproc):
    _, server, _ = inproc
    with pytest.raises(RuntimeError, match="did not prove this setup's store key"):
        StoreClient(HOST, server.port, key=BarrierKey.new(), connect_timeout_s=5)
    assert server.num_keys() == 0


def test_the_handle_stops_its_process():
    store = BarrierStore(host=HOST, key=BarrierKey.new())
    assert Path(f"/proc/{store.pid}").exists() and store.num_keys() == 0
    store.close()
    assert not Path(f"/proc/{store.pid}").exists()  # ended and reaped
    store.close()  # idempotent
    with pytest.raises(ValueError, match="wildcard"):
        BarrierStore(host="0.0.0.0", key=BarrierKey.new())
