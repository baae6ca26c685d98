"""Where a command's CPU time goes, by kind of process (the suite's budget work).

The suite is CPU-bound on the 2-core machines, and most of its time is the fixed cost of
starting processes (trainer and engine ranks, vLLM, Ray nodes), which pytest's durations do
not show. :class:`CpuSampler` reads every process's CPU time from ``/proc`` at an interval;
a process that existed before the sampler started counts only what it used since, one that
started later all of it (a process shorter than one interval may be missed).
:func:`process_kind` names a process by its command line (Ray actors by class), and
:func:`by_kind` sums::

    sampler = CpuSampler()
    ...                                  # the sampler's thread reads /proc every second
    rows = by_kind(sampler.stop())       # [(kind, cpu_seconds, processes), ...]

``scripts/suite_cpu.py`` runs a command under it and prints the table.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CpuSampler", "ProcCpu", "by_kind", "parse_stat", "process_kind"]

_HZ = os.sysconf("SC_CLK_TCK")

# (pattern on the command line, kind), first match wins; Ray actors are "ray::<Class>"
_KINDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), k) for p, k in (
        (r"EngineCore", "vllm EngineCore"),
        (r"^VLLM::(\S+)", r"vllm \1"),
        (r"vllm\.entrypoints|vllm serve", "vllm server"),
        (r"^ray::IDLE", "ray idle worker"),
        (r"^ray::(DashboardAgent|RuntimeEnvAgent)", "ray node (agents)"),
        (r"^ray::([A-Za-z_][\w]*)", r"ray actor \1"),
        (r"default_worker\.py", "ray worker (starting)"),
        (r"/raylet\b|/gcs_server\b|dashboard\.py|log_monitor\.py|autoscaler/_private/monitor",
         "ray node (daemons)"),
        (r"pytest|xdist|execnet|exec\(eval\(sys\.stdin", "pytest"),
        (r"multiprocessing\.spawn|spawn_main|multiprocessing\.forkserver", "spawned child"),
        (r"actors\.tools\.cli|/bin/wt\b", "wt command"),
        (r"weight_transfer\.sync\.store\.server", "barrier store"),
    ))


def process_kind(cmdline: str) -> str:
    """The kind of a process from its command line (its title, for Ray workers and vLLM):
    ``"ray actor TrainerWorker"``, ``"vllm EngineCore"``, ``"pytest"`` ... or, for anything
    else, its first two words."""
    for pattern, kind in _KINDS:
        if (m := pattern.search(cmdline)) is not None:
            return m.expand(kind)
    words = cmdline.split()
    return " ".join(os.path.basename(w) if i == 0 else w
                    for i, w in enumerate(words[:2])) or "(no command line)"


def parse_stat(text: str) -> tuple[float, int]:
    """(CPU seconds, user + system; start time in clock ticks) of a ``/proc/<pid>/stat``
    line. The command name may hold spaces and parentheses: fields are read after the last
    ``)``."""
    rest = text[text.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / _HZ, int(rest[19])


@dataclass(slots=True)
class ProcCpu:
    """One process seen by the sampler: its last non-empty command line, the CPU seconds it
    had when first seen and when last seen, and whether it started before the sampler."""

    cmdline: str
    first: float
    last: float
    before: bool

    @property
    def seconds(self) -> float:
        return self.last - self.first if self.before else self.last


class CpuSampler:
    """Samples every process's CPU time from ``/proc`` in a thread of its own until
    :meth:`stop` (which returns what it saw, itself excluded)."""

    def __init__(self, interval_s: float = 1.0, proc: str = "/proc") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s}")
        self.interval_s, self.proc = interval_s, proc
        self.seen: dict[tuple[int, int], ProcCpu] = {}
        # now, in the clock ticks since boot that a process's start time is counted in
        self._t0 = int(float(_read(f"{proc}/uptime").split()[0]) * _HZ)
        self._me = os.getpid()
        self._stop = threading.Event()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """One pass over ``/proc``; a process that exits during it is skipped."""
        for name in os.listdir(self.proc):
            if not name.isdigit() or int(name) == self._me:
                continue
            try:
                cpu, start = parse_stat(_read(f"{self.proc}/{name}/stat"))
                key = (int(name), start)
                row = self.seen.get(key)
                if row is None:
                    row = self.seen[key] = ProcCpu("", cpu, cpu, before=start < self._t0)
                if row.last != cpu or not row.cmdline:
                    cmd = _read(f"{self.proc}/{name}/cmdline").replace("\0", " ").strip()
                    row.cmdline = cmd or row.cmdline  # a zombie's is empty: keep the last
                row.last = cpu
            except (OSError, ValueError, IndexError):
                continue

    def stop(self) -> list[ProcCpu]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return list(self.seen.values())


def by_kind(rows: Iterable[ProcCpu]) -> list[tuple[str, float, int]]:
    """(kind, CPU seconds, processes) per kind, most CPU first; processes that used none
    are left out."""
    sums: dict[str, list[float]] = {}
    for r in rows:
        if r.seconds > 0:
            acc = sums.setdefault(process_kind(r.cmdline), [0.0, 0])
            acc[0] += r.seconds
            acc[1] += 1
    return sorted(((k, s, int(n)) for k, (s, n) in sums.items()), key=lambda t: -t[1])


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")
