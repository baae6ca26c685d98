"""The stage model of the simulator: hand-computed small cases of scheduling.sim.stages."""

import numpy as np
import pytest

from scheduling.sim.gather import ring_allgather_seconds
from scheduling.sim.stages import GroupCosts, run_group


def costs(*, h2d=(0.0,), gather=(0.0,), prepare=(0.0,), wbytes=(1.0,), reserve=(1.0,),
          mesh=(0,)):
    """One row per rank from 1-D tuples (one rank) or 2-D lists (several)."""
    arr = [np.atleast_2d(np.asarray(x, dtype=np.float64))
           for x in (h2d, gather, prepare, wbytes, reserve)]
    n_r = arr[0].shape[0]
    empty = np.zeros(0, dtype=np.int64)
    return GroupCosts(ranks=np.arange(n_r), mesh=np.asarray(mesh, dtype=np.int64),
                      h2d=arr[0], gather=arr[1], prepare=arr[2], write_bytes=arr[3],
                      write_count=np.ones_like(arr[3]), reserve=arr[4], params=np.ones_like(arr[3]),
                      tasks=(empty, empty, empty))


@pytest.mark.parametrize(("nbytes", "n", "bw", "lat", "want"), [
    (8e9, 1, 1e9, 1e-3, 0.0),            # one rank: nothing to gather
    (8e9, 2, 1e9, 0.0, 4.0),             # half the bytes arrive
    (8e9, 8, 1e9, 1e-3, 7.0 + 7e-3),     # (n-1)/n * bytes / bw + (n-1) * latency
])
def test_ring_allgather(nbytes, n, bw, lat, want):
    assert ring_allgather_seconds(np.array([nbytes]), n, bw, lat)[0] == pytest.approx(want)


@pytest.mark.parametrize(("case", "nic_s", "watermark", "want"), [
    # one write at its NIC rate: 2 bytes in 2 s
    (dict(wbytes=(2.0,)), [2.0], 10, 2.0),
    # one gather then one write: 1 + 2
    (dict(gather=(1.0,), wbytes=(2.0,)), [2.0], 10, 3.0),
    # two params pipelined: prepare 1 each, writes 1 each -> 1 + 1 + 1
    (dict(h2d=(0, 0), gather=(0, 0), prepare=(1.0, 1.0), wbytes=(1.0, 1.0),
          reserve=(1.0, 1.0)), [2.0], 10, 3.0),
    # the watermark fits one param: the second waits for the first write -> 2 + 2
    (dict(h2d=(0, 0), gather=(0, 0), prepare=(1.0, 1.0), wbytes=(1.0, 1.0),
          reserve=(1.0, 1.0)), [2.0], 1, 4.0),
    # FP8 quantization as prepare time (source bytes / rate) then the write
    (dict(prepare=(4e9 / 2e9,), wbytes=(1.0,)), [1.0], 10, 3.0),
    # h2d, gather, prepare, write in sequence
    (dict(h2d=(0.5,), gather=(1.0,), prepare=(0.25,), wbytes=(1.0,)), [1.0], 10, 2.75),
])
def test_hand_computed(case, nic_s, watermark, want):
    t = run_group(costs(**case), np.asarray(nic_s), watermark=watermark, write_overhead_s=0.0)
    assert t.seconds == pytest.approx(want)


def test_gather_is_a_collective_it_waits_for_the_slowest_rank():
    # rank 1's h2d takes 2 s; both ranks of the mesh start the gather then
    c = costs(h2d=[[0.0], [2.0]], gather=[[1.0], [1.0]], prepare=[[0.0], [0.0]],
              wbytes=[[1.0], [1.0]], reserve=[[1.0], [1.0]], mesh=(0, 0))
    t = run_group(c, np.array([1.0, 1.0]), watermark=10, write_overhead_s=0.0)
    assert t.write_start[:, 0] == pytest.approx([3.0, 3.0])
    assert t.seconds == pytest.approx(4.0)


def test_write_latency_per_write():
    t = run_group(costs(wbytes=(1.0,)), np.array([1.0]), watermark=10, write_overhead_s=0.5)
    assert t.seconds == pytest.approx(1.5)


@pytest.mark.parametrize(("overhead", "want"), [
    # prepares (0.5 s of fixed cost each) overlap the writes: 0.5 + 2 x (1 + 0.25)
    (0.25, 3.0),
    # without a write overhead: 0.5 + 1 + 1
    (0.0, 2.5),
])
def test_fixed_costs_pipelined(overhead, want):
    c = costs(h2d=(0, 0), gather=(0, 0), prepare=(0.5, 0.5), wbytes=(1.0, 1.0),
              reserve=(1.0, 1.0))
    t = run_group(c, np.array([2.0]), watermark=10, write_overhead_s=overhead)
    assert t.seconds == pytest.approx(want)
    assert t.busy["write"][0] == pytest.approx(2.0 + 2 * overhead)
