"""The reference engine's EngineAdapter: its registrable buffer, and a pause point.

The engine itself is not modified. An :class:`EngineAdapter` exposes the memory
regions that hold the engine's weights (one buffer with its tensors' names,
shapes, dtypes and byte offsets, registered with a NIC once at setup) and
pause/resume hooks, which the controller uses to keep generation from reading a
half-written version::

    adapter = ReferenceEngineAdapter(engine)
    for buf, tensors in adapter.region_buffers():
        desc = nic.register(buf)              # tensors: [(name, shape, dtype, offset)]
    adapter.pause()      # generate() finishes its current step, then waits
    adapter.wait_idle()  # no step runs now: safe to write
    ...                  # remote WRITEs land in the engine's buffer
    adapter.resume()     # generation continues with the new weights

How the reference adapter pauses a TP replica: every generation step of the
engine runs inside the adapter's guard. Entering it, the ranks agree (a max
all-reduce over the replica's group) on the highest pause number any of them
has seen; if that pause is new, every rank parks at this same step boundary
until its own ``resume()`` has covered it. So a rank whose ``pause()`` arrives a
little later still stops at the boundary its peers stop at, and no rank is ever
left waiting inside a step's collectives while its weights are rewritten.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

from weight_transfer.engines.adapter import TensorEntry
from weight_transfer.engines.reference.buffer import EngineBuffer
from weight_transfer.engines.reference.engine import ReferenceEngine

STEPS_KEPT = 100_000  # step start times kept (a bounded record, for measurements)


class ReferenceEngineAdapter:
    """:class:`EngineAdapter` of a :class:`ReferenceEngine`, through its ``step_guard``."""

    engine_name = "reference"

    def __init__(self, engine: ReferenceEngine) -> None:
        if engine.step_guard is not None:
            raise ValueError("the engine already has a step_guard (another adapter?)")
        self.engine = engine
        self._cond = threading.Condition()
        self._pauses = self._resumes = self._honored = 0
        self._busy = False  # inside a step, or about to agree on entering one
        self._parked = False  # a step is held at the boundary
        self._shadow: EngineBuffer | None = None
        # time.time() at the start of each of the latest generation steps (wt bench stall)
        self.step_starts: deque[float] = deque(maxlen=STEPS_KEPT)
        # meet(key, timeout_s) of a TP replica's ranks before a flip parks them (set by the
        # actor that knows the replica's store: weight_transfer.engines.shadow.rank)
        self.rendezvous: Callable[[str, float], bool] | None = None
        engine.step_guard = self._step

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._pauses > self._resumes

    def region_buffers(self) -> list[tuple[torch.Tensor, Sequence[TensorEntry]]]:
        return [(self.engine.buffer, self.engine.specs())]

    def shadow_buffers(self) -> list[tuple[torch.Tensor, Sequence[TensorEntry]]]:
        """A second buffer in the engine's layout (shadow mode), allocated once, pre-faulted
        and filled with the live bytes; paired with :meth:`region_buffers` one to one."""
        if self._shadow is None:
            self._shadow = EngineBuffer(self.engine.slots())
            self._shadow.buffer.copy_(self.engine.buffer)
        return [(self._shadow.buffer, self._shadow.specs())]

    def pause(self) -> None:
        """No new generation step starts until :meth:`resume` (idempotent)."""
        with self._cond:
            if self._pauses == self._resumes:
                self._pauses += 1

    def resume(self) -> None:
        with self._cond:
            self._resumes = self._pauses
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """After :meth:`pause`: True once no step runs (parked or not generating),
        False if ``timeout`` seconds pass first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout)

    def wait_parked(self, timeout: float | None = None) -> bool:
        """True once a generation step is held at the boundary (also on a TP peer's
        pause that this rank has not received yet); False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._parked, timeout)

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        with self._cond:
            mine, self._busy = self._pauses, True
        try:
            agreed = self.engine.tp.all_max(mine)  # every TP rank, same step
            with self._cond:
                if agreed > self._honored:
                    self._honored = agreed
                    self._busy, self._parked = False, True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._resumes >= agreed)
                    self._busy, self._parked = True, False
            self.step_starts.append(time.time())
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
