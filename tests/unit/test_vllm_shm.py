"""The shared memory an engine's processes left is found while they run and removed after
them (weight_transfer.engines.vllm.shm): a segment still mapped by a live process is left
alone. Real segments in /dev/shm, made by child processes that skip Python's own clean-up
(as a stopped vLLM engine core does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weight_transfer.engines.vllm.shm import (
    SHM_DIR,
    descendants,
    engine_segments,
    live_pids,
    remove_unmapped,
    stop_and_remove,
)

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


def test_a_stop_waits_for_a_slow_worker_but_not_for_a_process_that_maps_nothing(caplog):
    """A TP worker still exiting after the engine core's shutdown returned: its segment is
    removed once it is gone. A child that maps nothing (a resource tracker lives as long
    as its parent) is not waited for: no warning, and it is still running after."""
    slow, name = _child()
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def stop() -> None:  # returns at once; the worker exits half a second later
            subprocess.Popen(["sh", "-c", f"sleep 0.5; kill {slow.pid}"])

        removed = stop_and_remove(stop, timeout_s=30.0)
        assert removed == [name] and not (SHM_DIR / name).exists()
        assert slow.poll() is not None or slow.wait(5) is not None
        assert idle.poll() is None  # never waited for
        assert "still up" not in caplog.text
    finally:
        for proc in (slow, idle):
            proc.kill()
            proc.wait()


def test_segments_already_gone_are_skipped():
    assert remove_unmapped(["psm_never_there_" + str(time.monotonic_ns())]) == []


def test_an_unreadable_or_finished_process_maps_nothing():
    from weight_transfer.engines.vllm.shm import mapped_segments

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert mapped_segments([proc.pid]) == set()
    assert not Path(f"/proc/{proc.pid}").exists() or mapped_segments([proc.pid]) == set()


OWNER = """
import importlib.util, subprocess, sys, time
spec = importlib.util.spec_from_file_location("shm", sys.argv[1])
shm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shm)
engine = subprocess.Popen([sys.executable, "-c", sys.argv[2]], stdout=subprocess.PIPE, text=True)
name = engine.stdout.readline().strip()
shm.unlink_at_exit(shm.engine_segments())
print(name, engine.pid, flush=True)
time.sleep(60)
"""


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def test_a_killed_owners_segments_are_removed_by_a_watcher_outside_its_tree():
    """As ``ray.kill`` of a user's vLLM actor: the owner process and its children are killed
    with SIGKILL, nothing runs in them; the watcher that unlink_at_exit started is not
    among them and removes the segment the owner's engine mapped."""
    import weight_transfer.engines.vllm.shm as shm

    owner = subprocess.Popen([sys.executable, "-c", OWNER, shm.__file__, CHILD],
                             stdout=subprocess.PIPE, text=True)
    name, engine = owner.stdout.readline().split()
    try:
        assert (SHM_DIR / name).exists()
        watchers, until = [], time.monotonic() + 60  # its exec may still be under way
        while not watchers and time.monotonic() < until:
            watchers = [pid for pid in live_pids()
                        if _argv(pid)[1:3] == [shm.__file__, str(owner.pid)]]
        assert len(watchers) == 1 and watchers[0] not in descendants(owner.pid)
    finally:
        for pid in (owner.pid, int(engine)):
            os.kill(pid, 9)
        owner.wait()
    deadline = time.monotonic() + 120  # generous: the machine may be loaded
    while (SHM_DIR / name).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (SHM_DIR / name).exists(), f"{name} outlived its killed owner"


def test_a_segment_another_live_process_maps_is_left_alone_by_the_watcher():
    proc, name = _child()
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        import weight_transfer.engines.vllm.shm as shm

        assert shm.watch(gone.pid, [name], limit_s=1.0) == []  # its user still runs
        assert (SHM_DIR / name).exists()
    finally:
        proc.kill()
        proc.wait()
    assert remove_unmapped([name]) == [name]


def test_a_servers_process_group_is_found_until_its_last_process_exits():
    """VllmServer.close waits for every process of the server's group (an engine process
    outliving the API server too), then removes what they mapped."""
    from weight_transfer.engines.vllm.shm import group_pids

    leader = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(group_pids(leader.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = group_pids(leader.pid)
        assert leader.pid in members and len(members) == 3
        assert os.getpid() not in members
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()
    deadline = time.monotonic() + 10
    while group_pids(leader.pid) and time.monotonic() < deadline:  # init reaps the sleeps
        time.sleep(0.05)
    assert group_pids(leader.pid) == []
