"""The stage pipeline: FIFO order, overlap of stages, watermark, spans, failures."""

import asyncio

import pytest

from weight_transfer.sender.pipeline import Pipeline, PipelineError, PipelineItem, Stage
from weight_transfer.sender.watermark import ByteWatermark


def items(n, reserve=10):
    return [PipelineItem(key=i, reserve_bytes=reserve, payload=i, nbytes=i) for i in range(n)]


def test_results_in_input_order_and_each_stage_applied():
    async def add1(x):
        return x + 1

    async def times10(x):
        await asyncio.sleep(0.001 * (x % 3))
        return x * 10

    pipe = Pipeline([Stage("a", add1), Stage("b", times10, concurrency=3)])
    out = asyncio.run(pipe.run(items(20)))
    assert out == [(i + 1) * 10 for i in range(20)]
    assert {(s.key, s.stage) for s in pipe.spans} == {(i, st) for i in range(20) for st in "ab"}


def test_single_worker_stage_keeps_fifo_order():
    seen = []

    async def record(x):
        seen.append(x)
        await asyncio.sleep(0)
        return x

    async def slow_first(x):
        await asyncio.sleep(0.002 if x == 0 else 0)
        return x

    pipe = Pipeline([Stage("collective", record), Stage("after", slow_first, concurrency=4)])
    asyncio.run(pipe.run(items(30)))
    assert seen == list(range(30))


def test_stages_of_different_items_overlap():
    async def prepare(x):
        await asyncio.sleep(0.01)
        return x

    async def write(x):
        await asyncio.sleep(0.01)
        return x

    pipe = Pipeline([Stage("prepare", prepare), Stage("write", write)])
    asyncio.run(pipe.run(items(5)))
    spans = {(s.key, s.stage): s for s in pipe.spans}
    # prepare of item k+1 starts before write of item k ends: the queues decouple the stages.
    overlaps = [
        spans[(k + 1, "prepare")].start < spans[(k, "write")].end for k in range(4)
    ]
    assert all(overlaps)


def test_watermark_bounds_items_in_flight():
    inside = 0
    peak = 0

    async def enter(x):
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        return x

    async def leave(x):
        nonlocal inside
        await asyncio.sleep(0.001)
        inside -= 1
        return x

    wm = ByteWatermark(30)
    pipe = Pipeline([Stage("enter", enter), Stage("leave", leave, concurrency=8)], watermark=wm)
    asyncio.run(pipe.run(items(40, reserve=10)))
    assert peak <= 3
    assert wm.peak <= 30
    assert wm.held == 0


def test_oversized_item_runs_alone():
    wm = ByteWatermark(30)

    async def check(x):
        if x == 5:
            assert wm.held == 100
        return x

    its = items(10, reserve=10)
    its[5].reserve_bytes = 100
    pipe = Pipeline([Stage("check", check)], watermark=wm)
    assert asyncio.run(asyncio.wait_for(pipe.run(its), 5)) == list(range(10))
    assert wm.oversized == 1


def test_failure_names_item_and_stage_and_releases_bytes():
    async def boom(x):
        if x == 3:
            raise OSError("link down")
        return x

    wm = ByteWatermark(25)
    pipe = Pipeline([Stage("prepare", boom)], watermark=wm)
    with pytest.raises(PipelineError, match=r"stage 'prepare' failed for item 3: link down"):
        asyncio.run(pipe.run(items(10)))


def test_bad_construction():
    async def f(x):
        return x

    with pytest.raises(ValueError, match="at least one stage"):
        Pipeline([])
    with pytest.raises(ValueError, match="repeat"):
        Pipeline([Stage("a", f), Stage("a", f)])
    with pytest.raises(ValueError, match="concurrency"):
        Stage("a", f, concurrency=0)


def test_drain_waits_instead_of_spinning_once_every_item_is_fed(monkeypatch):
    import weight_transfer.sender.pipeline as pipeline_mod

    calls = 0
    real_wait = asyncio.wait

    async def counting_wait(*args, **kwargs):
        nonlocal calls
        calls += 1
        return await real_wait(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod.asyncio, "wait", counting_wait)

    async def slow(x):
        await asyncio.sleep(0.01)
        return x

    pipe = Pipeline([Stage("slow", slow)], watermark=ByteWatermark(1 << 30))
    asyncio.run(pipe.run(items(10)))
    # One wake-up per finished item, plus one when the feeder ends: never a busy loop.
    assert calls <= 10 + 2
