"""Wall and CPU seconds per phase of one process's part of an update.

A phase's CPU is the whole process's (``time.process_time``: every thread, so a
pool thread's work done during the phase counts in it), its wall the
``perf_counter`` span; phases are consecutive, each ending at the next mark::

    clock = PhaseClock()
    ...                              # the directive
    clock.mark("directive")
    ...                              # the pause
    clock.mark("begin")
    clock.phases                     # {"directive": Phase(wall=..., cpu=...), "begin": ...}
    clock.as_dict()                  # {"directive": {"wall": ..., "cpu": ...}, ...}
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """Seconds of one phase: wall clock, and CPU of the whole process."""

    wall: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: Phase) -> Phase:
        return Phase(wall=self.wall + other.wall, cpu=self.cpu + other.cpu)

    def as_dict(self) -> dict[str, float]:
        return {"wall": self.wall, "cpu": self.cpu}


class PhaseClock:
    """Consecutive phases of one process (see the module docstring)."""

    def __init__(self) -> None:
        self.phases: dict[str, Phase] = {}
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def mark(self, name: str) -> Phase:
        """End the phase ``name`` now (a name marked twice adds up); its seconds."""
        wall, cpu = time.perf_counter(), time.process_time()
        got = Phase(wall=wall - self._wall, cpu=cpu - self._cpu)
        self._wall, self._cpu = wall, cpu
        self.phases[name] = self.phases.get(name, Phase()) + got
        return got

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {k: v.as_dict() for k, v in self.phases.items()}


class ThreadTimer:
    """Wall and this thread's CPU (``time.thread_time``) summed over timed calls, for work
    that a pool thread does in pieces (a bucket's prepare, a batch's encode)::

        timer = ThreadTimer()
        with timer:
            work()
        timer.wall, timer.cpu
    """

    __slots__ = ("_c0", "_w0", "cpu", "wall")

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self._w0 = self._c0 = 0.0

    def __enter__(self) -> ThreadTimer:
        self._w0, self._c0 = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._w0
        self.cpu += time.thread_time() - self._c0

    def phase(self) -> Phase:
        return Phase(wall=self.wall, cpu=self.cpu)
