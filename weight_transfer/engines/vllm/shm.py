"""Shared memory an engine we started leaves behind: found while it runs, removed after it.

vLLM's processes talk through POSIX shared memory (``/dev/shm/psm_*``: the broadcast queue
from the engine core to its TP workers). When the engine core is stopped from outside, as
``LLM.llm_engine.engine_core.shutdown()`` does, nothing unlinks the segment it created: each
engine start at TP>1 left 160 MiB of RAM behind. Whoever started the engine owns that memory
(:class:`~actors.vllm.engine.VllmEngineOwner`)::

    unlink_at_exit(engine_segments())     # after this process ends, however (ray.kill too)
    ...
    stop_and_remove(engine_core.shutdown) # stop it, wait for its processes to exit, then
                                          # remove what they mapped and nothing maps now

A user's own engine in a Ray actor (:mod:`actors.vllm.handle`) is usually stopped by
``ray.kill`` of the actor: nothing runs in it then, so :func:`unlink_at_exit` leaves the
work to a watcher process outside the actor's tree, which removes the segments once the
actor's process is gone and the engine's processes have let go of them.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def mapped_segments(pids: Iterable[int]) -> set[str]:
    """Names of the ``/dev/shm`` files the processes ``pids`` map (those that vanished skip)."""
    out: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # exited, or not ours to read
            continue
        for line in maps.splitlines():
            path = line.rsplit(None, 1)[-1] if "/dev/shm/" in line else ""
            if path.startswith(f"{SHM_DIR}/"):
                out.add(path[len(f"{SHM_DIR}/"):])
    return out


def live_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the name (state, ppid, pgrp, ...); None once it exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the name may hold spaces


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies left out)."""
    out = []
    for pid in live_pids():
        fields = _stat_fields(pid)
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(pid)
    return out


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, theirs, ...), read from ``/proc``."""
    parents: dict[int, list[int]] = {}
    for child in live_pids():
        fields = _stat_fields(child)
        if fields:
            parents.setdefault(int(fields[1]), []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def wait_exited(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until each of ``pids`` has exited (a zombie counts as exited: it maps nothing),
    at most ``timeout_s``; those still running then."""
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while True:
        left = [p for p in left if (f := _stat_fields(p)) is not None and f[0] != "Z"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def engine_segments() -> set[str]:
    """The segments this process's descendants (the engine's processes) map now."""
    return mapped_segments(descendants(os.getpid()))


def stop_and_remove(stop: Callable[[], Any], timeout_s: float = 30.0) -> list[str]:
    """Call ``stop()`` (which stops the engine this process started), wait up to
    ``timeout_s`` for the engine's processes that map shared memory to exit (a TP worker
    goes on exiting after the engine core's ``shutdown()`` returns; a resource tracker,
    which maps none, lives as long as this process), then remove the segments they mapped
    that nothing maps any more; the names removed."""
    holders = {pid: mapped_segments([pid]) for pid in descendants(os.getpid())}
    holders = {pid: names for pid, names in holders.items() if names}  # not a resource tracker
    segments = set().union(*holders.values())
    stop()
    if left := wait_exited(holders, timeout_s):
        log.warning("engine processes %s still up %g s after shutdown; their shared memory "
                    "is left to the exit watcher", left, timeout_s)
    return remove_unmapped(segments)


def remove_unmapped(segments: Iterable[str]) -> list[str]:
    """Unlink each of ``segments`` that still exists and that no live process maps; the
    names removed. A segment still mapped (another engine's, or a process still exiting)
    is left alone."""
    left = [s for s in segments if (SHM_DIR / s).exists()]
    if not left:
        return []
    in_use = mapped_segments(live_pids())
    removed = []
    for name in left:
        if name in in_use:
            continue
        try:
            (SHM_DIR / name).unlink()
            removed.append(name)
        except FileNotFoundError:  # its creator removed it meanwhile
            continue
    if removed:
        log.info("removed %d shared-memory segments the stopped engine left: %s",
                 len(removed), removed)
    return removed



WATCH_LIMIT_S = 120.0  # how long the watcher waits for the engine's processes to let go


def unlink_at_exit(segments: Iterable[str], pid: int | None = None) -> None:
    """Remove each of ``segments`` once process ``pid`` (this one) has ended, however it
    ends (``ray.kill`` and SIGKILL included) and no live process maps it any more.

    A watcher process does it, started outside this process's tree: Ray kills a dead
    actor's child processes with it, and Python's own resource tracker is one. The
    watcher runs this file as a script (the standard library only) and ends when its
    work is done."""
    segments = sorted(segments)
    if not segments:
        return
    pid = os.getpid() if pid is None else pid
    # `sh -c "... &"` in a new session: the shell exits at once and the watcher, its child,
    # is adopted by init, outside this process's tree and process group.
    subprocess.run(["sh", "-c", '"$@" </dev/null >/dev/null 2>&1 &', "sh", sys.executable,
                    str(Path(__file__).resolve()), str(pid), *segments],
                   check=True, start_new_session=True)


def watch(pid: int, segments: list[str], limit_s: float = WATCH_LIMIT_S) -> list[str]:
    """Wait for ``pid`` to end, then remove ``segments`` as their last users let go (within
    ``limit_s``); the names removed."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        pass  # gone already
    else:
        select.select([fd], [], [])
        os.close(fd)
    removed: list[str] = []
    deadline = time.monotonic() + limit_s
    while True:
        removed += remove_unmapped(segments)
        if not [s for s in segments if (SHM_DIR / s).exists()] or time.monotonic() > deadline:
            return removed
        time.sleep(0.5)


if __name__ == "__main__":  # the watcher of unlink_at_exit: PID SEGMENT...
    watch(int(sys.argv[1]), sys.argv[2:])
