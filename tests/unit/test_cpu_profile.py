"""actors.tools.testkit.cpu_profile: process kinds, /proc stat lines, the sampler's counting,
the CPU time given to the test module running when it was used."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.tools.testkit.cpu_profile import (
    OUTSIDE,
    TIMELINE_ENV,
    CpuSampler,
    ModuleSpan,
    ProcCpu,
    by_kind,
    by_module,
    parse_stat,
    process_kind,
    read_timeline,
)


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
    # comm may hold spaces and ")": fields 4 (ppid), 14/15 (utime, stime), 22 (starttime)
    fields = ["S"] + [str(i) for i in range(4, 53)]
    fields[1], fields[11], fields[12], fields[19] = "777", "250", "50", "123456"
    line = "4242 (evil) name (x)) " + " ".join(fields)
    cpu, start, ppid = parse_stat(line)
    assert cpu == pytest.approx(300 / os.sysconf("SC_CLK_TCK")) and start == 123456
    assert ppid == 777


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


def _proc(pid, ppid, start, samples, before=False, first=0.0):
    return ProcCpu("x", first, samples[-1][1], before=before, pid=pid, ppid=ppid,
                   start_s=start, samples=samples)


def test_cpu_goes_to_the_module_its_pytest_ancestor_ran_when_it_was_used():
    spans = [ModuleSpan(100, "a.py", 10.0, 20.0), ModuleSpan(100, "b.py", 21.0, 30.0),
             ModuleSpan(200, "c.py", 10.0, 40.0)]
    rows = [
        _proc(100, 1, 0.0, [(15.0, 50.0)], before=True, first=48.0),  # the worker: 2 in a
        _proc(110, 100, 11.0, [(12.0, 3.0)]),  # a raylet the worker started in a.py ...
        _proc(111, 110, 12.0, [(13.0, 1.0), (25.0, 4.0)]),  # ... its actor, on into b.py
        _proc(120, 111, 20.5, [(22.0, 2.0)]),  # started between modules: the next one's
        _proc(210, 200, 15.0, [(16.0, 5.0)]),  # the other worker's
        _proc(300, 1, 15.0, [(16.0, 7.0)]),  # no pytest ancestor
        _proc(130, 100, 31.0, [(32.0, 1.0)]),  # after the worker's last module
    ]
    got = {m: (round(s, 6), n) for m, s, n in by_module(rows, spans)}
    assert got == {"a.py": (2.0 + 3.0 + 1.0, 2), "b.py": (3.0 + 2.0, 1), "c.py": (5.0, 1),
                   OUTSIDE: (8.0, 2)}


def test_a_loop_in_the_parent_table_ends():
    rows = [_proc(5, 6, 1.0, [(2.0, 1.0)]), _proc(6, 5, 1.0, [(2.0, 1.0)])]
    assert by_module(rows, [ModuleSpan(100, "a.py", 0.0, 9.0)]) == [(OUTSIDE, 2.0, 2)]


def test_a_timeline_line_that_is_not_four_fields_is_refused(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text("100\ta.py\t1.0\t2.0\n\n100\tb.py\t3.0\n")
    with pytest.raises(ValueError, match=r"t\.tsv:3: not pid<TAB>module"):
        read_timeline(path)
    path.write_text("100\ta.py\t1.0\t2.0\n")
    assert read_timeline(path) == [ModuleSpan(100, "a.py", 1.0, 2.0)]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_pytest_writes_each_modules_span_and_the_sampler_gives_it_its_childs_cpu(tmp_path):
    """A real pytest run under the sampler: the module that starts a busy child owns its
    CPU time; the other module does not."""
    (tmp_path / "test_busy.py").write_text(
        "import subprocess, sys\n"
        "def test_busy():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt=time.process_time()\\n"
        "while time.process_time()-t<0.5: pass'], check=True)\n")
    (tmp_path / "test_idle.py").write_text("def test_idle():\n    pass\n")
    (tmp_path / "conftest.py").write_text(
        f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
        f"from tests.conftest import pytest_runtest_protocol  # noqa: F401\n")
    timeline = tmp_path / "timeline.tsv"
    sampler = CpuSampler(interval_s=0.05)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, TIMELINE_ENV: str(timeline)}, timeout=120)
    rows = sampler.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spans = read_timeline(timeline)
    assert sorted(s.module.rsplit("/", 1)[-1] for s in spans) == ["test_busy.py", "test_idle.py"]
    got = {m.rsplit("/", 1)[-1]: s for m, s, _ in by_module(rows, spans)}
    assert got["test_busy.py"] >= 0.4 and got.get("test_idle.py", 0.0) < 0.4, got
