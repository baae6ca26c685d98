"""Outsider attacks on the trainers' barrier store: each fails, is detected and named.

The outsider is a process of its own (``tests/outsider/store_client.py``: plain
Python and torch's stock TCPStore client, nothing of the project, no secret)
that knows the store's address, as anyone who scans the node can. The ranks are
threads of this process with real ``StoreBarrier`` clients.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist
from outsider.driver import Outsider  # tests/ is on sys.path (its conftest.py)

from weight_transfer.errors import BarrierRefusedError, BarrierTimeoutError
from weight_transfer.sync.barrier import BarrierKey, StoreBarrier
from weight_transfer.sync.listen import serve_store

pytestmark = pytest.mark.slow  # spawns a process that imports torch

@pytest.fixture(scope="module")
def outsider():
    o = Outsider()
    yield o
    o.close()


@pytest.fixture()
def store():
    return serve_store("127.0.0.1", timeout_s=10)


def client(store):
    return dist.TCPStore("127.0.0.1", store.port, is_master=False,
                         timeout=datetime.timedelta(seconds=10))


class Rank(threading.Thread):
    """One rank crossing ``tag``; ``result``: the seconds waited, or the exception."""

    def __init__(self, store, key, rank, tag, *, ranks=(0, 1), timeout_s=10.0) -> None:
        super().__init__()
        self.barrier = StoreBarrier(client(store), rank=rank, ranks=ranks, key=key,
                                    timeout_s=timeout_s)
        self.tag, self.result = tag, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.barrier.wait(self.tag)
        except Exception as exc:
            self.result = exc

    def outcome(self):
        self.join(60)
        assert not self.is_alive()
        return self.result


def until(cond) -> None:
    """Synchronise with the ranks (a deadline for a hang, not a timed assert)."""
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, "the rank never arrived"
        time.sleep(0.01)


def refused(result, *, rank: int, tag: str, reason: str) -> None:
    assert isinstance(result, BarrierRefusedError), result
    assert (result.rank, result.tag, result.reason) == (rank, tag, reason)
    assert f"{reason} arrival of rank {rank}" in str(result) and tag in str(result)


def at(store, **cmd) -> dict:
    return dict(host="127.0.0.1", port=store.port, **cmd)


def test_listing_gives_nothing_to_replay_and_release_early_by_replay_is_named(store, outsider):
    key = BarrierKey.new()
    first = Rank(store, key, 0, "v1/g0")
    until(lambda: store.check([f"{key.name}/v1/g0/0"]))
    keys = outsider(**at(store, op="list"))["keys"]
    assert list(keys) == [f"{key.name}/v1/g0/0"]  # a random name: not "wt-update/v1/g0/0"
    assert key.secret.hex() not in json.dumps(keys)
    # Release early: replay rank 0's value as rank 1's arrival.
    outsider(**at(store, op="copy", src=f"{key.name}/v1/g0/0", dst=f"{key.name}/v1/g0/1"))
    refused(first.outcome(), rank=1, tag="v1/g0", reason="forged")
    # The real rank 1, arriving now, finds a value it did not set.
    refused(Rank(store, key, 1, "v1/g0").outcome(), rank=1, tag="v1/g0", reason="pre-arrived")


def test_a_forged_arrival_of_a_missing_rank_is_named_and_releases_nobody(store, outsider):
    key = BarrierKey.new()
    first = Rank(store, key, 0, "v2/g1")
    until(lambda: store.check([f"{key.name}/v2/g1/0"]))
    outsider(**at(store, op="set", key=f"{key.name}/v2/g1/1", value="1"))
    refused(first.outcome(), rank=1, tag="v2/g1", reason="forged")


def test_a_pre_arrival_for_a_future_version_is_named(store, outsider):
    key = BarrierKey.new()
    first = Rank(store, key, 0, "v1/g0")
    until(lambda: store.check([f"{key.name}/v1/g0/0"]))
    name = next(iter(outsider(**at(store, op="list"))["keys"])).rsplit("/", 3)[0]
    outsider(**at(store, op="set", key=f"{name}/v9/g0/1", value="f" * 64))
    assert isinstance(Rank(store, key, 1, "v1/g0").outcome(), float)
    assert isinstance(first.outcome(), float)
    later = [Rank(store, key, r, "v9/g0") for r in (0, 1)]
    refused(later[0].outcome(), rank=1, tag="v9/g0", reason="forged")
    refused(later[1].outcome(), rank=1, tag="v9/g0", reason="pre-arrived")


def test_a_guessed_tag_of_the_old_naming_has_no_effect(store, outsider):
    key = BarrierKey.new()
    outsider(**at(store, op="set", key="wt-update/v3/g0/1", value="1"))
    ranks = [Rank(store, key, r, "v3/g0") for r in (0, 1)]
    assert all(isinstance(r.outcome(), float) for r in ranks)


def test_a_deleted_arrival_is_named_by_the_rank_that_made_it(store, outsider):
    key = BarrierKey.new()
    first = Rank(store, key, 0, "v4/g0", timeout_s=3.0)
    until(lambda: store.check([f"{key.name}/v4/g0/0"]))
    assert outsider(**at(store, op="delete", key=f"{key.name}/v4/g0/0")) == {"deleted": True}
    second = Rank(store, key, 1, "v4/g0", timeout_s=0.5).outcome()
    assert isinstance(second, BarrierTimeoutError) and second.missing == (0,)
    refused(first.outcome(), rank=0, tag="v4/g0", reason="deleted")
