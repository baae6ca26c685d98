"""The fence between a trainer's optimizer step and the writes that read its memory.

A zero-copy update (:mod:`weight_transfer.sender.zero_copy.sources`) writes straight
from the trainer's parameters, so the next optimizer step must not change them before
the writes complete; a snapshot update copies them first, so the step waits only
for the copies. One :class:`StepFence` per trainer rank orders the two:

1. the trainer's step runs inside ``with fence.step():`` (the mixin's
   ``wt_step_fence``): it waits while an update holds the fence, then marks a
   step in flight;
2. an update calls ``fence.hold()`` before it reads a source: it waits for the
   step in flight to end (no update reads half-stepped weights), then holds
   the fence; ``fence.release()`` once its writes (zero-copy) or its copies
   (snapshot) are done.

``wait_writes()`` is the step's wait alone, for trainers that cannot wrap their
step in a ``with``; ``busy`` says whether a step is in flight or waiting, which
``source="auto"`` takes as a trainer that steps during updates (a snapshot then).
Pure threading: the step and the update run on different threads of a trainer::

    fence = StepFence(label="trainer rank 0")
    with fence.step(timeout_s=60):
        optimizer.step()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class StepFence:
    """See the module docstring."""

    def __init__(self, *, label: str = "trainer") -> None:
        self.label = label
        self._cond = threading.Condition()
        self._held = 0  # updates holding the fence (their sources still read)
        self._steps = 0  # steps in flight
        self._waiting = 0  # steps waiting for an update to release the fence
        self.waited = 0  # steps that had to wait for an update (tests, metrics)

    @property
    def held(self) -> bool:
        with self._cond:
            return self._held > 0

    @property
    def busy(self) -> bool:
        """Whether a step is in flight or waiting for the fence."""
        with self._cond:
            return self._steps > 0 or self._waiting > 0

    def _wait(self, ready, what: str, timeout_s: float | None) -> None:
        if not self._cond.wait_for(ready, timeout_s):
            raise TimeoutError(f"{self.label}: {what} waited {timeout_s} s for the "
                               "weight-transfer fence")

    def _await_release(self, timeout_s: float | None) -> None:
        """Wait (the lock held) until no update holds the fence."""
        if self._held:
            self.waited += 1
        self._waiting += 1
        try:
            self._wait(lambda: self._held == 0, "the optimizer step", timeout_s)
        finally:
            self._waiting -= 1

    def wait_writes(self, timeout_s: float | None = None) -> None:
        """Block until no update reads this trainer's memory (TimeoutError after
        ``timeout_s``)."""
        with self._cond:
            self._await_release(timeout_s)

    @contextlib.contextmanager
    def step(self, timeout_s: float | None = None) -> Iterator[None]:
        """An optimizer step: waits for the fence, and keeps updates from reading the
        sources until it ends."""
        with self._cond:
            self._await_release(timeout_s)
            self._steps += 1
        try:
            yield
        finally:
            with self._cond:
                self._steps -= 1
                self._cond.notify_all()

    def hold(self, timeout_s: float | None = None) -> None:
        """An update begins reading the sources: waits for the step in flight to end."""
        with self._cond:
            self._wait(lambda: self._steps == 0, "the weight update", timeout_s)
            self._held += 1

    def release(self) -> None:
        """The update no longer reads the sources (writes or copies done)."""
        with self._cond:
            if self._held <= 0:
                raise RuntimeError(f"{self.label}: fence released more often than held")
            self._held -= 1
            self._cond.notify_all()
