"""The byte watermark: exact accounting, FIFO admission, oversized tasks run alone."""

import asyncio
import random

import pytest

from weight_transfer.sender.watermark import ByteWatermark


def run(coro):
    return asyncio.run(coro)


def test_rejects_bad_limit_and_negative_reservation():
    with pytest.raises(ValueError, match="positive"):
        ByteWatermark(0)
    wm = ByteWatermark(10)
    with pytest.raises(ValueError, match="negative"):
        run(wm.acquire(-1))


def test_release_more_than_held_is_an_error():
    wm = ByteWatermark(10)
    with pytest.raises(RuntimeError, match="exceeds"):
        wm.release(1)


@pytest.mark.parametrize("seed", range(5))
def test_peak_never_exceeds_limit_under_random_load(seed):
    rng = random.Random(seed)
    limit = 1000
    sizes = [rng.randint(1, limit) for _ in range(200)]

    async def main():
        wm = ByteWatermark(limit)
        live = 0
        max_live = 0

        async def task(n):
            nonlocal live, max_live
            async with wm.reserve(n):
                live += n
                max_live = max(max_live, live)
                assert live <= wm.held <= limit  # held counts every granted reservation
                await asyncio.sleep(0)
                await asyncio.sleep(rng.random() * 1e-4)
                live -= n

        await asyncio.gather(*(task(n) for n in sizes))
        return wm, max_live

    wm, max_live = run(main())
    assert wm.peak <= limit
    assert max_live <= wm.peak
    assert wm.held == 0


def test_task_larger_than_limit_runs_alone_without_deadlock():
    async def main():
        wm = ByteWatermark(100)
        order = []

        async def task(name, n, hold):
            async with wm.reserve(n):
                order.append((name, "in", wm.held))
                await asyncio.sleep(hold)
                order.append((name, "out", wm.held))

        await asyncio.wait_for(
            asyncio.gather(task("a", 60, 0.01), task("big", 500, 0.01), task("b", 30, 0.0)),
            timeout=5,
        )
        return wm, order

    wm, order = run(main())
    # "big" entered only when nothing else was held, and held exactly its own bytes.
    assert ("big", "in", 500) in order
    assert wm.oversized == 1
    assert wm.held == 0


def test_admission_is_fifo():
    async def main():
        wm = ByteWatermark(100)
        await wm.acquire(90)
        admitted = []

        async def waiter(name, n):
            await wm.acquire(n)
            admitted.append(name)

        t_big = asyncio.create_task(waiter("big", 50))
        await asyncio.sleep(0)
        t_small = asyncio.create_task(waiter("small", 5))  # would fit now, but must queue
        await asyncio.sleep(0.01)
        assert admitted == []
        wm.release(90)
        await asyncio.gather(t_big, t_small)
        return admitted

    assert run(main()) == ["big", "small"]


def test_cancelled_waiter_leaves_no_bytes_held():
    async def main():
        wm = ByteWatermark(100)
        await wm.acquire(100)
        t = asyncio.create_task(wm.acquire(50))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        wm.release(100)
        await asyncio.wait_for(wm.acquire(100), timeout=1)
        return wm.held

    assert run(main()) == 100
