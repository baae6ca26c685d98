"""StoreBarrier over a real TCPStore on loopback, ranks as threads."""

import datetime
import threading

import pytest
import torch.distributed as dist

from weight_transfer.barrier import StoreBarrier


@pytest.fixture()
def store():
    return dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )


def run_ranks(store, ranks, present, tag, timeout_s):
    results: dict[int, object] = {}

    def body(r):
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=datetime.timedelta(seconds=10))
        b = StoreBarrier(client, rank=r, ranks=ranks, timeout_s=timeout_s)
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
        StoreBarrier(store, rank=9, ranks=[0, 1])
    with pytest.raises(ValueError, match="timeout"):
        StoreBarrier(store, rank=0, ranks=[0], timeout_s=0)
