"""The cost of checking served memory (docs/reliability.md, "Writes after the resume").

On a local Ray instance with the demo cluster (4 trainer ranks -> 2 replicas x TP2):

* seconds of one ``ctl.check_integrity()`` (full: every served byte of every replica),
  integrity ``full`` (the trainers' checksums are the reference);
* seconds an update gains in ``sample`` mode when the background check is on (the engine
  ranks hash their tensors for the reference, paused, before the resume): updates with
  and without it, and that step alone (``reference_s``);
* CPU seconds per background tick of ``integrity_watch_bytes`` (engine processes and the
  controller's process, less an idle window of the same length) and the CPU share that
  gives at a tick every ``--interval`` seconds.

    wt bench served --model configs/models/tiny_llama.yaml --json out.json
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import ray

from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers

TICK_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids):
    """utime + stime of ``pids`` (seconds), from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICK_S


def window(pids, seconds):
    """CPU seconds of ``pids`` and of this process over ``seconds`` of wall time."""
    a, p = cpu_seconds(pids), time.process_time()
    time.sleep(seconds)
    return cpu_seconds(pids) - a + time.process_time() - p


def fleet(cfg):
    trainers, replicas = launch_trainers(cfg), launch_engines(cfg)
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    return ctl, [a for r in replicas for a in r]


def pids_of(actors):
    return ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])


def run(model: Path, cluster: Path, *, checks: int = 5, updates: int = 4,
        window_s: float = 20.0, interval: float = 10.0, json_out: Path | None = None) -> int:
    ray.init(address="local", num_cpus=16, include_dashboard=False)
    out = {"model": str(model), "cluster": str(cluster)}
    cfg = TransferConfig.from_files(model, cluster, integrity={"mode": "full"})
    ctl, engines = fleet(cfg)
    ctl.update(1)
    runs = [ctl.check_integrity() for _ in range(checks)]
    assert all(r.ok for r in runs)
    out["served_bytes"] = runs[0].check.bytes
    out["full_check_s"] = statistics.median(r.check.seconds for r in runs)
    ctl.shutdown()
    # Sample mode: updates with the reference kept (watch on) and without, interleaved on one
    # controller (the machine's load drifts), and the reference step alone.
    cfg = TransferConfig.from_files(model, cluster, integrity_watch_s=3600.0)
    ctl = WeightTransferController(trainers=ctl.trainers, engines=list(ctl.replicas.values()),
                                   config=cfg)
    ctl.setup()
    ctl.update(10)
    secs = {"on": [], "off": []}
    for i in range(2 * updates):
        which = "on" if i % 2 else "off"
        ctl._served.config = cfg if which == "on" else cfg.replace(integrity_watch_s=0.0)
        secs[which].append(ctl.update(11 + i).seconds)
    ctl._served.config = cfg
    out["update_s_watch_off"] = statistics.median(secs["off"])
    out["update_s_watch_on"] = statistics.median(secs["on"])
    names, took = list(ctl.replicas), []
    for _ in range(checks):
        t0 = time.perf_counter()
        assert len(ctl._served.reference(99, names, [], timeout_s=60)) == len(names)
        took.append(time.perf_counter() - t0)
    out["reference_s"] = statistics.median(took)
    pids = pids_of(engines)
    idle = window(pids, window_s)
    ctl.watch.stop()  # the hour-long one; ticks below are driven at 1 s to count many
    from actors.controller.served import BackgroundCheck
    ctl.watch = BackgroundCheck(ctl._watch_tick, interval_s=1.0, lock=ctl._busy).start()
    busy = window(pids, window_s)
    ticks = ctl.watch.ticks
    per_tick = max(0.0, busy - idle) / max(ticks, 1)
    out.update(watch_bytes=cfg.integrity_watch_bytes, ticks=ticks, idle_cpu_s=idle,
               busy_cpu_s=busy, cpu_s_per_tick=per_tick,
               tick_wall_s=ctl.watch.busy_s / max(ticks, 1), interval_s=interval,
               cpu_share=per_tick / interval, cores=os.cpu_count())
    ctl.shutdown()
    print(json.dumps(out, indent=2))
    if json_out is not None:
        json_out.write_text(json.dumps(out, indent=2) + "\n")
    return 0
