"""The engine side of epoch-fenced commands: the version held, pause and resume, events.

Every engine keeps one :class:`CommandFence` (the reference engine one per
rank, vLLM one per replica: the controller gives a replica's ranks the same
epoch). The controller's pause, resume and version commands carry an epoch
(:func:`actors.controller.engine_control.next_epoch`); the fence ignores a command older
than the newest it has seen and refuses a resume that comes after its wall
clock deadline, so a rank that was stopped while the controller gave up on it
does not serve again when it continues. The engine says what a command does
through a callback, run under the fence's lock::

    fence = CommandFence("engine0/tp1")
    fence.pause(epoch, stop=adapter.pause)                   # False: stale, ignored
    fence.resume(7, epoch, deadline, go=adapter.resume)      # False: stale or late
    fence.resume(KEEP, None, None, go=...)                   # keep the version held

:data:`KEEP` ("no version given") pickles as itself, so it crosses Ray intact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

EVENTS_KEPT = 1024  # events() keeps this many latest pause/resume/version events


class _Keep:
    """The type of :data:`KEEP`; one instance, restored as itself by pickle."""

    _instance: _Keep | None = None

    def __new__(cls) -> _Keep:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> str:
        return "KEEP"  # pickled by reference: the module's KEEP

    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()

Event = tuple[str, Any, float]  # (event, version held, time.time())


class CommandFence:
    """Epoch fence, version held and the latest events of one engine (rank or replica)."""

    def __init__(self, owner: str, *, events_kept: int = EVENTS_KEPT) -> None:
        self.owner = owner
        self.version: Any = None
        # The version generation computes with: set by a resume or a version command. A
        # pause does not clear it (no step runs while paused; version-tagged outputs).
        self.served: Any = None
        self.epoch = 0  # the newest controller epoch seen
        # The latest events only: a long run must not grow the engine's memory.
        self._events: deque[Event] = deque(maxlen=events_kept)
        self._lock = threading.Lock()

    def record(self, event: str) -> None:
        self._events.append((event, self.version, time.time()))

    def events(self) -> list[Event]:
        return list(self._events)

    def _admit(self, epoch: int | None, what: str) -> bool:
        """Whether a command of ``epoch`` is current (None: unfenced, from a user); under
        the lock. A command older than the newest one seen is ignored."""
        if epoch is None:
            return True
        if epoch < self.epoch:
            log.warning("%s ignored a stale %s (epoch %d < %d)", self.owner, what, epoch,
                        self.epoch)
            self.record(f"stale {what}")
            return False
        self.epoch = epoch
        return True

    def pause(self, epoch: int | None, stop: Callable[[], None]) -> bool:
        """Run ``stop`` unless the command is stale; a fenced pause comes before writes or
        holds a torn replica, so the version held becomes None until a resume names one."""
        with self._lock:
            if not self._admit(epoch, "pause"):
                return False
            if epoch is not None:
                self.version = None
            stop()
        return True

    def resume(self, version: Any, epoch: int | None, deadline: float | None,
               go: Callable[[], None]) -> bool:
        """Record ``version`` (unless :data:`KEEP`) as held and run ``go``; refused (False,
        nothing changes) when stale or when ``time.time()`` is past ``deadline``."""
        with self._lock:
            if not self._admit(epoch, "resume"):
                return False
            if deadline is not None and time.time() > deadline:
                log.warning("%s refused a resume to version %s that came %.3f s after its "
                            "deadline", self.owner, version, time.time() - deadline)
                self.record("late resume")
                return False
            if version is not KEEP:
                self.version = version
            self.served = self.version
            go()
        return True

    def set_version(self, version: Any, epoch: int | None,
                    apply: Callable[[Any], None] | None = None) -> bool:
        """Record the version held without a pause (``pause_during_update`` off)."""
        with self._lock:
            if not self._admit(epoch, "version"):
                return False
            self.version = self.served = version
            if apply is not None:
                apply(version)
            self.record("version")
        return True

    def swap(self, what: str, epoch: int | None, deadline: float | None,
             run: Callable[[Any], Any]) -> bool:
        """A flip or a rollback (shadow mode): ``run(version held)`` returns the version
        held after it and becomes it; refused (False, nothing changes) when stale or past
        ``deadline``. An error ``run`` raises (a refused flip) leaves the version as it was."""
        with self._lock:
            if not self._admit(epoch, what):
                return False
            if deadline is not None and time.time() > deadline:
                log.warning("%s refused a %s that came %.3f s after its deadline", self.owner,
                            what, time.time() - deadline)
                self.record(f"late {what}")
                return False
            self.version = self.served = run(self.version)
            self.record(what)
        return True

    def locked(self, run: Callable[[], Any]) -> Any:
        """``run()`` under the lock, with no epoch of its own (a step the controller orders
        between fenced commands, e.g. a delta apply into the shadow: no flip meanwhile)."""
        with self._lock:
            return run()

    def fenced(self, what: str, epoch: int | None, run: Callable[[], Any]) -> bool:
        """Run ``run`` under the lock unless the command is stale (a stage or a discard of
        the shadow: the version held does not change)."""
        with self._lock:
            if not self._admit(epoch, what):
                return False
            run()
            self.record(what)
        return True
