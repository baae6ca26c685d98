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

Per test module: pytest (``tests/conftest.py``) appends each module's span to the file
named by :data:`TIMELINE_ENV` (the worker's pid, the module, its first and last second on
the clock process start times are counted in), and :func:`by_module` gives each CPU second
a process used to the module its pytest process (an ancestor: the xdist worker that started
the Ray cluster, the vLLM server, the ``wt`` command) was running when it was used.

``scripts/suite_cpu.py`` runs a command under it and prints the tables.
"""

from __future__ import annotations

import os
import re
import threading
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["OUTSIDE", "TIMELINE_ENV", "CpuSampler", "ModuleSpan", "ProcCpu", "by_kind", "by_module",
           "parse_stat", "process_kind", "read_timeline", "uptime_s"]

_HZ = os.sysconf("SC_CLK_TCK")
TIMELINE_ENV = "WT_SUITE_TIMELINE"  # where pytest appends each test module's span

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


def parse_stat(text: str) -> tuple[float, int, int]:
    """(CPU seconds, user + system; start time in clock ticks since boot; parent pid) of a
    ``/proc/<pid>/stat`` line. The command name may hold spaces and parentheses: fields are
    read after the last ``)``."""
    rest = text[text.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / _HZ, int(rest[19]), int(rest[1])


def uptime_s(proc: str = "/proc") -> float:
    """Seconds since boot: the clock of a process's start time (``/proc/uptime``)."""
    return float(_read(f"{proc}/uptime").split()[0])


@dataclass(slots=True)
class ProcCpu:
    """One process seen by the sampler: its last non-empty command line, the CPU seconds it
    had when first seen and when last seen, whether it started before the sampler, and (for
    :func:`by_module`) its pid, parent, start (seconds since boot) and ``(seconds since
    boot, CPU seconds)`` at each sample where its CPU time grew."""

    cmdline: str
    first: float
    last: float
    before: bool
    pid: int = 0
    ppid: int = 0
    start_s: float = 0.0
    samples: list[tuple[float, float]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.last - self.first if self.before else self.last

    def used(self) -> Iterator[tuple[float, float]]:
        """(when, CPU seconds used since the sample before) for each growth seen; a process
        that started after the sampler used its first sample's CPU time from its start."""
        prev = self.first if self.before else 0.0
        for i, (t, cpu) in enumerate(self.samples):
            when = self.start_s if i == 0 and not self.before else t
            if cpu > prev:
                yield when, cpu - prev
            prev = cpu


class CpuSampler:
    """Samples every process's CPU time from ``/proc`` in a thread of its own until
    :meth:`stop` (which returns what it saw, itself excluded)."""

    def __init__(self, interval_s: float = 1.0, proc: str = "/proc") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s}")
        self.interval_s, self.proc = interval_s, proc
        self.seen: dict[tuple[int, int], ProcCpu] = {}
        # now, in the clock ticks since boot that a process's start time is counted in
        self._t0 = int(uptime_s(proc) * _HZ)
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
        now = uptime_s(self.proc)
        for name in os.listdir(self.proc):
            if not name.isdigit() or int(name) == self._me:
                continue
            try:
                cpu, start, ppid = parse_stat(_read(f"{self.proc}/{name}/stat"))
                key = (int(name), start)
                row = self.seen.get(key)
                if row is None:
                    row = self.seen[key] = ProcCpu("", cpu, cpu, before=start < self._t0,
                                                   pid=int(name), ppid=ppid,
                                                   start_s=start / _HZ)
                    if not row.before:
                        row.samples.append((now, cpu))
                if row.last != cpu or not row.cmdline:
                    cmd = _read(f"{self.proc}/{name}/cmdline").replace("\0", " ").strip()
                    row.cmdline = cmd or row.cmdline  # a zombie's is empty: keep the last
                if cpu > row.last:
                    row.samples.append((now, cpu))
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


@dataclass(frozen=True, slots=True)
class ModuleSpan:
    """A test module's run on one pytest process: its fixtures' set-up to their teardown."""

    pid: int
    module: str
    start_s: float
    end_s: float


def read_timeline(path: str | Path) -> list[ModuleSpan]:
    """The spans pytest appended to ``path`` (tab-separated: pid, module, start, end)."""
    spans = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                pid, module, start, end = line.split("\t")
                spans.append(ModuleSpan(int(pid), module, float(start), float(end)))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not pid<TAB>module<TAB>start<TAB>end: "
                                 f"{line!r}") from exc
    return spans


OUTSIDE = "(outside any module)"


def by_module(rows: Iterable[ProcCpu],
              spans: Iterable[ModuleSpan]) -> list[tuple[str, float, int]]:
    """(module, CPU seconds, processes started during it) per test module, most CPU first.

    A process belongs to the pytest process among its ancestors (itself included); each
    CPU second it used goes to the module that pytest process ran at the time (between two
    modules: the next one, which is what the previous one's teardown or the gap leads to);
    what no pytest process is an ancestor of, or came after the last module, is
    :data:`OUTSIDE`. A process counts as started by the module it first used CPU in.
    """
    rows = list(rows)
    parent = {r.pid: r.ppid for r in rows}
    by_pid: dict[int, list[ModuleSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_s):
        by_pid.setdefault(span.pid, []).append(span)
    ends = {pid: [s.end_s for s in ss] for pid, ss in by_pid.items()}

    def owner(pid: int) -> int | None:
        for _ in range(64):  # a loop in the table (a reused pid) ends here
            if pid in by_pid:
                return pid
            if pid not in parent or pid <= 1:
                return None
            pid = parent[pid]
        return None

    cpu: dict[str, float] = {}
    started: dict[str, int] = {}
    for r in rows:
        pid = owner(r.pid)
        first = True
        for when, seconds in r.used():
            if pid is None:
                module = OUTSIDE
            else:
                i = bisect_right(ends[pid], when)  # the first span ending after `when`
                module = by_pid[pid][i].module if i < len(ends[pid]) else OUTSIDE
            cpu[module] = cpu.get(module, 0.0) + seconds
            if first:
                started[module] = started.get(module, 0) + (not r.before)
                first = False
    return sorted(((m, s, started.get(m, 0)) for m, s in cpu.items()), key=lambda t: -t[1])


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")
