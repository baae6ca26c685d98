"""The TP ranks of a replica meet before a flip parks them (``store_rendezvous`` over a real
TCPStore on loopback): nobody goes on until every rank came, and a rank whose peer never
comes goes on after the timeout, saying so."""

from __future__ import annotations

import datetime
import logging
import threading
import time

import pytest
import torch.distributed as dist

from weight_transfer.engines.shadow.rank import store_rendezvous


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                timeout=datetime.timedelta(seconds=30))


def test_no_rank_goes_on_before_the_last_one_came(store):
    ranks = 3
    meets = [store_rendezvous(store(), ranks, prefix="wt-flip/engine0") for _ in range(ranks)]
    went_on: dict[int, float] = {}

    def rank(i: int, delay: float) -> None:
        time.sleep(delay)
        assert meets[i]("flip/7", 10.0)
        went_on[i] = time.monotonic()

    start = time.monotonic()
    threads = [threading.Thread(target=rank, args=(i, 0.3 * i)) for i in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert sorted(went_on) == [0, 1, 2]
    assert min(went_on.values()) - start >= 0.6  # the last came 0.6 s in: nobody left before


def test_a_peer_that_never_comes_is_waited_for_the_timeout_only(store, caplog):
    meet = store_rendezvous(store(), 2, prefix="wt-flip/engine1")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert meet("flip/8", 0.5) is False
    assert 0.4 <= time.monotonic() - start < 10
    assert "wt-flip/engine1/flip/8: not every TP rank came to the flip within 0.5 s" in caplog.text


def test_each_command_meets_under_its_own_key(store):
    a, b = (store_rendezvous(store(), 2, prefix="wt-flip/engine0") for _ in range(2))
    for key in ("flip/1", "rollback/2", "flip/3"):
        other = threading.Thread(target=b, args=(key, 10.0))
        other.start()
        assert a(key, 10.0)
        other.join(timeout=10)
    assert a("flip/4", 0.2) is False  # an earlier key's arrivals do not count for a new one
