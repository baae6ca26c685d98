"""Run a command and print where its CPU time went, by kind of process
(:mod:`actors.tools.testkit.cpu_profile`)::

    python scripts/suite_cpu.py -- bash scripts/test.sh --durations=0
    python scripts/suite_cpu.py --top 30 --json cpu.json -- .venv/bin/python -m pytest tests/unit
    python scripts/suite_cpu.py --modules -- bash scripts/test.sh     # and per test module

Prints the command's wall time, the CPU seconds of every process seen (those that started
before it: only what they used since) against what the machine's cores had, and the table
by kind (with ``--modules``, also by test module: pytest writes each module's span to a
file the sampler reads, see :func:`~actors.tools.testkit.cpu_profile.by_module`); exits
with the command's exit code.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/suite_cpu.py` puts scripts/ first, not the root
    sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    import argparse
    import json
    import os
    import subprocess
    import tempfile
    import time

    from actors.tools.testkit.cpu_profile import (
        TIMELINE_ENV,
        CpuSampler,
        by_kind,
        by_module,
        read_timeline,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--top", type=int, default=25, help="kinds shown")
    parser.add_argument("--json", help="write every process seen (kind, command, CPU-s, "
                        "parent, samples) and the modules' spans here")
    parser.add_argument("--modules", action="store_true",
                        help="also the CPU seconds by test module (the command runs pytest)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    env = dict(os.environ)
    timeline = None
    if args.modules:
        fd, timeline = tempfile.mkstemp(prefix="wt-suite-timeline-", suffix=".tsv")
        os.close(fd)
        env[TIMELINE_ENV] = timeline
    sampler = CpuSampler(args.interval)
    t0 = time.monotonic()
    try:
        rc = subprocess.call(command, env=env)
    finally:
        wall = time.monotonic() - t0
        rows = sampler.stop()
    total = sum(r.seconds for r in rows)
    cores = os.cpu_count() or 1
    print(f"\n{' '.join(command)}: exit {rc}, {wall:.0f} s wall; {total:.0f} CPU-s of the "
          f"{wall * cores:.0f} {cores} cores had ({100 * total / (wall * cores):.0f}%)")
    print(f"{'CPU-s':>8} {'procs':>6}  kind")
    for kind, seconds, n in by_kind(rows)[: args.top]:
        print(f"{seconds:8.1f} {n:6d}  {kind}")
    spans = []
    if timeline is not None:
        spans = read_timeline(timeline)
        os.unlink(timeline)
        print(f"\nby test module ({len(spans)} seen):\n{'CPU-s':>8} {'procs':>6}  module")
        for module, seconds, n in by_module(rows, spans)[: args.top]:
            print(f"{seconds:8.1f} {n:6d}  {module}")
    if args.json:
        from dataclasses import asdict

        from actors.tools.testkit.cpu_profile import process_kind

        Path(args.json).write_text(json.dumps({
            "processes": [{"kind": process_kind(r.cmdline), "cmdline": r.cmdline,
                           "cpu_s": r.seconds, "pid": r.pid, "ppid": r.ppid,
                           "start_s": r.start_s, "before": r.before, "first": r.first,
                           "samples": r.samples} for r in rows if r.seconds > 0],
            "modules": [asdict(s) for s in spans]}))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
