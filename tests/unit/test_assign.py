"""The pure assignment steps: tables of small cases and properties on random inputs.

In the style of checkpoint-engine's test_assign_receiver_ranks: each case
spells out the inputs and the exact expected output.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.build.assign import (
    assign_sources,
    greedy_batches_many,
    interleave_order,
    mesh_groups,
    spread_order,
)


@pytest.mark.parametrize(
    ("meshes", "groups"),
    [
        ([(0, 1, 2, 3)], [[0]]),
        # dense over all ranks first, then the two disjoint expert meshes together
        ([(0, 2), (1, 3), (0, 1, 2, 3)], [[2], [0, 1]]),
        # overlapping meshes of equal size go to different groups, first fit
        ([(0, 1), (1, 2), (2, 3), (3, 0)], [[0, 2], [1, 3]]),
        ([(0,), (1,), (2,)], [[0, 1, 2]]),
        ([(0, 1, 2), (3, 4), (2, 3)], [[0, 1], [2]]),
    ],
)
def test_mesh_groups(meshes, groups):
    assert mesh_groups(meshes) == groups


def test_mesh_groups_rejects_equal_rank_sets():
    with pytest.raises(ValueError, match="distinct rank sets"):
        mesh_groups([(0, 1), (1, 0)])


@pytest.mark.parametrize(
    ("signature", "nbytes", "order"),
    [
        # one stream: natural order
        ([0, 0, 0], [5, 5, 5], [0, 1, 2]),
        # two equal streams: a1 b1 a2 b2 ...
        ([0, 0, 1, 1], [1, 1, 1, 1], [0, 2, 1, 3]),
        # stream 1 has twice the bytes per item: it advances half as many items per step
        ([0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 2, 2], [0, 4, 1, 2, 5, 3]),
        # signatures need not be sorted or contiguous
        ([7, 3, 7, 3], [1, 1, 1, 1], [0, 1, 2, 3]),
        ([], [], []),
    ],
)
def test_interleave_order(signature, nbytes, order):
    assert interleave_order(np.array(signature), np.array(nbytes)).tolist() == order


@pytest.mark.parametrize(
    ("nbytes", "ranks", "rank_nic", "src", "nic_load"),
    [
        # one NIC per rank: largest item of each batch to the lightest NIC
        ([10, 20, 30], [0, 1, 2], [0, 1, 2], [2, 1, 0], [30, 20, 10]),
        # second batch fills the lightest first
        ([8, 8, 1, 1], [0, 1], [0, 1], [0, 1, 0, 1], [9, 9]),
        ([8, 2, 5, 5], [0, 1], [0, 1], [0, 1, 1, 0], [13, 7]),
        # ranks 0 and 1 share NIC 0: NIC balance first, then ranks on a NIC
        ([4, 4, 4, 4], [0, 1, 2], [0, 0, 1], [0, 2, 1, 2], [8, 8]),
        # the mesh only uses its own ranks
        ([3, 3], [1, 3], [0, 1, 2, 3], [1, 3], [0, 3, 0, 3]),
    ],
)
def test_assign_sources(nbytes, ranks, rank_nic, src, nic_load):
    rank_nic = np.array(rank_nic)
    loads = np.zeros(rank_nic.max() + 1, dtype=np.int64)
    rank_load = np.zeros(len(rank_nic), dtype=np.int64)
    got = assign_sources(np.array(nbytes), ranks, rank_nic, loads, rank_load)
    assert got.tolist() == src
    assert loads.tolist() == nic_load
    assert rank_load.sum() == sum(nbytes)


def test_assign_sources_continues_from_given_loads():
    loads = np.array([100, 0], dtype=np.int64)
    got = assign_sources(np.array([10, 10]), [0, 1], np.array([0, 1]), loads, np.zeros(2, int))
    assert got.tolist() == [1, 0]  # batch of two: larger-or-equal first to the lighter NIC
    assert loads.tolist() == [110, 10]


def test_assign_sources_rejects_empty_mesh():
    with pytest.raises(ValueError, match="empty mesh"):
        assign_sources(np.array([1]), [], np.array([0]), np.zeros(1, int), np.zeros(1, int))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=300),
    n_ranks=st.integers(1, 12),
    per_nic=st.integers(1, 3),
)
def test_assign_sources_spread_is_at_most_the_largest_item(sizes, n_ranks, per_nic):
    # Batched greedy (largest item to the lightest bin) keeps max - min <= largest item,
    # on NICs and, within a NIC, on its ranks.
    rank_nic = np.arange(n_ranks) // per_nic
    nic_load = np.zeros(rank_nic.max() + 1, dtype=np.int64)
    rank_load = np.zeros(n_ranks, dtype=np.int64)
    nbytes = np.array(sizes)
    src = assign_sources(nbytes, list(range(n_ranks)), rank_nic, nic_load, rank_load)
    assert np.bincount(src, weights=nbytes, minlength=n_ranks).tolist() == rank_load.tolist()
    assert nic_load.max() - nic_load.min() <= max(sizes)
    for nic in range(len(nic_load)):
        on_nic = rank_load[rank_nic == nic]
        assert on_nic.max() - on_nic.min() <= max(sizes)


def test_spread_order_rotates_destinations_by_sender():
    # two senders, each with one task to each of 3 destination NICs, same major key
    src = np.array([0, 0, 0, 1, 1, 1])
    dst = np.array([0, 1, 2, 0, 1, 2])
    rotation = np.array([0, 0, 0, 1, 1, 1])
    order = spread_order(src, np.zeros(6, int), dst, rotation, 3)
    assert dst[order].tolist() == [0, 1, 2, 1, 2, 0]
    assert src[order].tolist() == [0, 0, 0, 1, 1, 1]


def test_spread_order_keeps_major_order():
    src = np.array([0, 0, 0])
    major = np.array([2, 1, 1])
    order = spread_order(src, major, np.array([0, 1, 0]), np.zeros(3, int), 2)
    assert major[order].tolist() == [1, 1, 2]
    with pytest.raises(ValueError, match="positive"):
        spread_order(src, major, src, src, 0)


def test_greedy_batches_many_small_table():
    # job 0: bins (0, 1), items 5, 3, 4 -> 5 to bin 0, 3 to bin 1 (ties: bin order), then
    # 4 to the lighter bin 1; job 1: bin 2 alone takes both of its items
    load = np.zeros(3, dtype=np.int64)
    outs = [np.empty(3, dtype=np.int64), np.empty(2, dtype=np.int64)]
    greedy_batches_many([(np.array([5, 3, 4]), np.array([0, 1])),
                         (np.array([7, 1]), np.array([2]))], load, outs)
    assert outs[0].tolist() == [0, 1, 1] and outs[1].tolist() == [2, 2]
    assert load.tolist() == [5, 7, 8]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_greedy_batches_many_equals_jobs_one_after_the_other(data):
    n_jobs = data.draw(st.integers(1, 4))
    bins_all = data.draw(st.permutations(range(16)))
    jobs, start = [], 0
    for _ in range(n_jobs):
        k = data.draw(st.integers(1, 4))
        sizes = data.draw(st.lists(st.integers(0, 5), max_size=20))
        jobs.append((np.array(sizes, dtype=np.int64) * 1000,
                     np.sort(np.array(bins_all[start:start + k]))))
        start += k
    load0 = np.array(data.draw(st.lists(st.integers(0, 3), min_size=16, max_size=16))) * 500
    one_by_one, together = load0.copy(), load0.copy()
    want = [assign_sources(n, b.tolist(), np.arange(16), one_by_one, np.zeros(16, np.int64))
            for n, b in jobs]
    got = [np.empty(len(n), dtype=np.int64) for n, _ in jobs]
    greedy_batches_many(jobs, together, got)
    assert all((w == g).all() for w, g in zip(want, got, strict=True))
    assert (one_by_one == together).all()
