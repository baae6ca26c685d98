"""Shared memory an engine we started leaves behind: found while it runs, removed after it.

vLLM's processes talk through POSIX shared memory (``/dev/shm/psm_*``: the broadcast queue
from the engine core to its TP workers). When the engine core is stopped from outside, as
``LLM.llm_engine.engine_core.shutdown()`` does, nothing unlinks the segment it created: each
engine start at TP>1 left 160 MiB of RAM behind. Whoever started the engine owns that memory
(:class:`~actors.vllm.engine.VllmEngineOwner`)::

    segments = engine_segments()          # while the engine runs: what its processes map
    ...                                   # stop the engine
    removed = remove_unmapped(segments)   # those no live process maps any more
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

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


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, theirs, ...), read from ``/proc``."""
    parents: dict[int, list[int]] = {}
    for child in live_pids():
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces
        parents.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def engine_segments() -> set[str]:
    """The segments this process's descendants (the engine's processes) map now."""
    return mapped_segments(descendants(os.getpid()))


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
