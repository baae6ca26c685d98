"""Log a repeated event at most once per source per interval, counting the rest.

A flood (thousands of refused connections a second) must not become thousands of
log lines. The first event of a source is logged; later ones within ``every_s``
are only counted, and the next line after the interval says how many were not
logged::

    throttle = LogThrottle(every_s=60.0)
    skipped = throttle.due(host)          # None: counted, not logged now
    if skipped is not None:
        log.warning("refused %s (%d more from it not logged)", host, skipped)

At most ``max_sources`` sources are remembered (the least recently logged is
forgotten first), so a flood from many addresses cannot grow it without bound.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

LOG_EVERY_S = 60.0


class LogThrottle:
    """See the module docstring; ``clock`` is for tests."""

    def __init__(self, every_s: float = LOG_EVERY_S, *, max_sources: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_s < 0 or max_sources < 1:
            raise ValueError(f"LogThrottle: every_s must be >= 0 and max_sources >= 1, got "
                             f"{every_s} and {max_sources}")
        self.every_s, self.max_sources, self.clock = every_s, max_sources, clock
        self._last: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()  # (time, skipped)
        self._lock = threading.Lock()

    def due(self, source: Hashable) -> int | None:
        """None if ``source`` was logged within ``every_s`` (this event is counted);
        otherwise how many of its events were not logged since its last line."""
        now = self.clock()
        with self._lock:
            last = self._last.get(source)
            if last is not None and now - last[0] < self.every_s:
                self._last[source] = (last[0], last[1] + 1)
                return None
            self._last.pop(source, None)
            self._last[source] = (now, 0)
            while len(self._last) > self.max_sources:
                self._last.popitem(last=False)
            return 0 if last is None else last[1]
