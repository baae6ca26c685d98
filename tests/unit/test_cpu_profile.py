"""actors.tools.testkit.cpu_profile: process kinds, /proc stat lines, the sampler's counting."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from actors.tools.testkit.cpu_profile import CpuSampler, ProcCpu, by_kind, parse_stat, process_kind


@pytest.mark.parametrize(("cmdline", "kind"), [
    ("ray::TrainerWorker.train_step", "ray actor TrainerWorker"),
    ("ray::FaultyInferenceWorker", "ray actor FaultyInferenceWorker"),
    ("ray::IDLE", "ray idle worker"),
    ("ray::DashboardAgent", "ray node (agents)"),
    ("/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x",
     "ray node (daemons)"),
    ("/v/bin/python /v/ray/_private/workers/default_worker.py --node-ip-address=1",
     "ray worker (starting)"),
    ("VLLM::EngineCore", "vllm EngineCore"),
    ("VLLM::Worker_TP1", "vllm Worker_TP1"),
    ("/v/bin/python -m vllm.entrypoints.openai.api_server --model m", "vllm server"),
    ("/v/bin/python -c from multiprocessing.spawn import spawn_main; spawn_main(fd=5)",
     "spawned child"),
    ("/v/bin/python -m pytest -n 2 --dist loadfile", "pytest"),
    ("/v/bin/python -m actors.tools.cli.main demo --json -", "wt command"),
    ("/v/bin/python -m weight_transfer.sync.store.server --host 127.0.0.1", "barrier store"),
    ("/usr/bin/bash scripts/test.sh", "bash scripts/test.sh"),
    ("", "(no command line)"),
])
def test_processes_are_named_by_kind(cmdline, kind):
    assert process_kind(cmdline) == kind


def test_a_stat_line_is_read_after_the_last_parenthesis():
    # comm may hold spaces and ")": fields 14/15 (utime, stime) and 22 (starttime)
    fields = ["S"] + [str(i) for i in range(4, 53)]
    fields[11], fields[12], fields[19] = "250", "50", "123456"
    line = "4242 (evil) name (x)) " + " ".join(fields)
    cpu, start = parse_stat(line)
    assert cpu == pytest.approx(300 / os.sysconf("SC_CLK_TCK")) and start == 123456


def test_processes_from_before_count_only_what_they_used_since():
    rows = [ProcCpu("ray::TrainerWorker", 10.0, 14.0, before=True),
            ProcCpu("ray::TrainerWorker.wt_update", 0.0, 5.0, before=False),
            ProcCpu("ray::Scheduler", 2.0, 2.0, before=True)]  # used nothing since: left out
    assert by_kind(rows) == [("ray actor TrainerWorker", 9.0, 2)]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_the_sampler_sees_a_child_that_burns_cpu_and_not_itself():
    sampler = CpuSampler(interval_s=0.05)
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nt=time.process_time()\n"
                              "while time.process_time()-t<0.3: pass\ntime.sleep(0.3)"])
    child.wait(timeout=60)
    time.sleep(0.1)
    rows = sampler.stop()
    assert os.getpid() not in {pid for pid, _ in sampler.seen}
    mine = [r for (pid, _), r in sampler.seen.items() if pid == child.pid]
    assert len(mine) == 1 and not mine[0].before
    assert 0.2 <= mine[0].seconds <= 5.0, mine[0]  # its busy 0.3 s, sampled while it slept
    assert sum(r.seconds for r in rows) >= mine[0].seconds


def test_a_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        CpuSampler(interval_s=0)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_process_started_before_the_sampler_counts_from_its_first_sample():
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nt=time.process_time()\n"
                              "while time.process_time()-t<0.4: pass\ntime.sleep(30)"])
    try:
        while True:  # its busy part done before the sampler starts
            with open(f"/proc/{child.pid}/stat") as f:
                if parse_stat(f.read())[0] >= 0.4:
                    break
            time.sleep(0.05)
        sampler = CpuSampler(interval_s=0.05)
        time.sleep(0.2)
        sampler.stop()
        (row,) = [r for (pid, _), r in sampler.seen.items() if pid == child.pid]
        assert row.before and row.first >= 0.4 and row.seconds < 0.1, row
    finally:
        child.kill()
        child.wait()
