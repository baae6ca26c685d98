"""``wt soak``'s verdict: descriptors opened once late are warm-up, descriptors that keep
opening are a leak; a grown row names the kinds of descriptor that changed."""

from __future__ import annotations

import os
import socket

from actors.tools.demo.soak import TOLERANCE, _over_text, growth, process_stats


def stats(fds: int, threads: int = 30, **kinds: int) -> dict:
    return {"rss_bytes": 500 << 20, "fds": fds, "threads": threads,
            "fd_kinds": kinds or {"socket": fds}}


def test_descriptors_opened_once_in_the_first_half_are_warm_up():
    start, mid, end = stats(82), stats(85), stats(85)
    diff, over = growth(start, end, mid)
    assert diff["fds"] == 3 > TOLERANCE["fds"] and over == []


def test_descriptors_that_keep_opening_are_a_leak_and_their_kind_is_named():
    start = stats(80, socket=70, pipe=10)
    mid, end = stats(82, socket=70, pipe=12), stats(84, socket=70, pipe=14)
    diff, over = growth(start, end, mid)
    assert over == ["fds"] and diff["fd_kinds"] == {"pipe": 4}
    assert _over_text({"over": over, "growth": diff}) == "fds (pipe +4)"


def test_without_a_mid_point_the_tolerance_alone_decides():
    assert growth(stats(80), stats(83))[1] == ["fds"]
    assert growth(stats(80), stats(82))[1] == []


def test_threads_and_memory_and_store_keys():
    start = stats(80) | {"store_keys": 2}
    end = stats(80, threads=40) | {"store_keys": 3, "rss_bytes": (500 << 20) + (64 << 20)}
    mid = stats(80, threads=35) | {"store_keys": 3}
    assert sorted(growth(start, end, mid)[1]) == ["rss_bytes", "store_keys", "threads"]


def test_this_process_descriptors_are_counted_by_kind():
    before = process_stats()
    r, w = os.pipe()
    s = socket.socket()
    try:
        after = process_stats()
    finally:
        os.close(r), os.close(w), s.close()
    diff, _ = growth(before, after)
    assert diff["fds"] == 3 and diff["fd_kinds"] == {"pipe": 2, "socket": 1}


def test_a_writers_table_handle_pools_fill_up_to_max_inflight_late_and_that_is_no_leak():
    """The clean-clone failure: a trainer's handles on two engines' tables grew by 1, then 2,
    staying within the NIC's max_inflight of 4 per peer."""
    peer_a, peer_b = "/memfd:simnic-engine0/tp1-inode0", "/memfd:simnic-engine1/tp0-inode1"
    start = stats(70, **{"socket": 66, peer_a: 3, peer_b: 1}) | {"table_handle_bound": 4}
    mid = stats(71, **{"socket": 66, peer_a: 4, peer_b: 1})
    end = stats(73, **{"socket": 66, peer_a: 4, peer_b: 3})
    assert growth(start, end, mid)[1] == []
    leak = stats(75, **{"socket": 66, peer_a: 4, peer_b: 5})  # past the bound
    assert growth(start, leak, mid)[1] == ["table handles"]
    other = stats(74, **{"socket": 69, peer_a: 4, peer_b: 1})  # sockets still opening
    assert growth(start, other, mid)[1] == ["fds"]
