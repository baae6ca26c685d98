"""Wall and CPU per phase (weight_transfer.observe.phases): consecutive marks, a name
marked twice adds up, a pool thread's timed work counts its own CPU."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from weight_transfer.observe.phases import Phase, PhaseClock, ThreadTimer


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_phases_are_consecutive_and_add_up() -> None:
    clock = PhaseClock()
    _spin(0.02)
    first = clock.mark("a")
    time.sleep(0.02)
    clock.mark("b")
    _spin(0.01)
    clock.mark("a")
    assert first.cpu >= 0.02 and first.wall > 0  # spun on this thread's CPU clock
    assert clock.phases["b"].wall >= 0.02  # slept
    assert clock.phases["a"].cpu >= 0.03
    assert set(clock.as_dict()) == {"a", "b"}
    assert clock.as_dict()["b"] == {"wall": clock.phases["b"].wall, "cpu": clock.phases["b"].cpu}
    assert Phase(wall=1, cpu=2) + Phase(wall=3, cpu=4) == Phase(wall=4, cpu=6)


def test_thread_timer_counts_its_threads_cpu() -> None:
    timer = ThreadTimer()

    def work() -> None:
        with timer:
            _spin(0.02)
        with timer:
            time.sleep(0.02)

    with ThreadPoolExecutor(1) as pool:
        pool.submit(work).result()
    assert timer.cpu >= 0.02 and timer.wall >= 0.04
    assert timer.phase() == Phase(wall=timer.wall, cpu=timer.cpu)
