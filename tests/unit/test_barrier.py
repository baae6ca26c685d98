"""StoreBarrier on loopback, ranks as threads: over a real TCPStore and over our barrier
store (:mod:`weight_transfer.sync.store`, its server in this process)."""

import datetime
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from weight_transfer.sync.barrier import BarrierKey, StoreBarrier
from weight_transfer.sync.listen import serve_store
from weight_transfer.sync.store import StoreClient
from weight_transfer.sync.store.protocol import namespace, store_identity, store_key
from weight_transfer.sync.store.server import StoreServer

KEY = BarrierKey.new()


@pytest.fixture(params=["tcpstore", "ours"])
def store(request):
    """``.num_keys()`` and ``.client()`` (a client of its own per thread: one TCPStore
    socket is not shared between threads)."""
    if request.param == "tcpstore":
        server = serve_store("127.0.0.1", timeout_s=10)
        yield SimpleNamespace(num_keys=server.num_keys, client=lambda: dist.TCPStore(
            "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10)))
        return
    server = StoreServer(host="127.0.0.1", link_key=store_key(KEY), namespace=namespace(KEY),
                         target_id=store_identity(KEY))
    yield SimpleNamespace(num_keys=server.num_keys, client=lambda: StoreClient(
        "127.0.0.1", server.port, key=KEY, timeout_s=10))
    server.close()


def client(store):
    return store.client()


def run_ranks(store, ranks, present, tag, timeout_s):
    results: dict[int, object] = {}

    def body(r):
        b = StoreBarrier(client(store), rank=r, ranks=ranks, key=KEY, timeout_s=timeout_s)
        try:
            results[r] = b.wait(tag)
        except Exception as exc:
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in present]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_all_ranks_pass(store):
    res = run_ranks(store, range(4), range(4), "v1/g0", timeout_s=20)
    assert sorted(res) == [0, 1, 2, 3]
    assert all(isinstance(v, float) for v in res.values())


def test_tags_are_independent(store):
    assert all(isinstance(v, float) for v in run_ranks(store, [0, 1], [0, 1], "a", 20).values())
    assert all(isinstance(v, float) for v in run_ranks(store, [0, 1], [0, 1], "b", 20).values())


def test_timeout_names_missing_ranks(store):
    res = run_ranks(store, [0, 1, 2, 5], [0, 2], "v3/g1", timeout_s=0.3)
    for r in (0, 2):
        assert isinstance(res[r], TimeoutError)
        assert "ranks [1, 5] of [0, 1, 2, 5] did not arrive" in str(res[r])
        assert "v3/g1" in str(res[r])


def test_bad_arguments(store):
    with pytest.raises(ValueError, match="rank 9 is not one of"):
        StoreBarrier(client(store), rank=9, ranks=[0, 1], key=KEY)
    with pytest.raises(ValueError, match="timeout"):
        StoreBarrier(client(store), rank=0, ranks=[0], key=KEY, timeout_s=0)


def test_store_does_not_grow_with_updates(store):
    """Each crossing deletes its keys once every rank passed: N updates, no growth."""
    before = store.num_keys()
    for version in range(1, 21):
        res = run_ranks(store, range(3), range(3), f"v{version}/g0", timeout_s=20)
        assert all(isinstance(v, float) for v in res.values()), res
        assert store.num_keys() == before, f"after update {version}"


def test_waiting_blocks_in_the_store_not_in_a_sleep_loop(store, monkeypatch):
    calls = {"sleep": 0, "check": 0}

    def no_sleep(*a):
        calls["sleep"] += 1

    monkeypatch.setattr(time, "sleep", no_sleep)

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def check(self, keys):
            calls["check"] += 1
            return self.inner.check(keys)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    late = threading.Timer(
        0.3, lambda: StoreBarrier(client(store), rank=1, ranks=[0, 1], key=KEY).wait("t"))
    late.start()
    waited = StoreBarrier(Counting(client(store)), rank=0, ranks=[0, 1], key=KEY,
                          timeout_s=20).wait("t")
    late.join()
    assert waited >= 0.2
    assert calls == {"sleep": 0, "check": 0}  # the arrivals are read back, never polled

