"""The shared memory an engine's processes left is found while they run and removed after
them (actors.vllm.shm): a segment still mapped by a live process is left alone. Real
segments in /dev/shm, made by child processes that skip Python's own clean-up (as a
stopped vLLM engine core does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.vllm.shm import SHM_DIR, descendants, engine_segments, remove_unmapped

CHILD = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 16)
resource_tracker.unregister(shm._name, "shared_memory")  # nobody cleans up after a kill
print(shm.name, flush=True)
time.sleep(60)
"""

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this machine")


def _child() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_stopped_engines_segment_is_found_then_removed():
    proc, name = _child()
    try:
        assert proc.pid in descendants(os.getpid())
        found = engine_segments()
        assert name in found
        assert remove_unmapped([name]) == []  # still mapped by its live process: kept
        assert (SHM_DIR / name).exists()
    finally:
        proc.kill()
        proc.wait()
    assert (SHM_DIR / name).exists()  # the kill left it, as vLLM's engine core does
    assert name in remove_unmapped(found)
    assert not (SHM_DIR / name).exists()


def test_segments_already_gone_are_skipped():
    assert remove_unmapped(["psm_never_there_" + str(time.monotonic_ns())]) == []


def test_an_unreadable_or_finished_process_maps_nothing():
    from actors.vllm.shm import mapped_segments

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert mapped_segments([proc.pid]) == set()
    assert not Path(f"/proc/{proc.pid}").exists() or mapped_segments([proc.pid]) == set()
