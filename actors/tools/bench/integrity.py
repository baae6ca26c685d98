"""Benchmark integrity checks: update seconds with checksums off, sampled and full, in one run.

One set of actors (the run config's cluster: 4 FSDP2 trainer ranks -> 2
replicas x TP2 by default) serves every mode; for each mode in turn a
controller with ``TransferConfig.integrity`` set to it does ``setup()``, one
warm-up update and ``--updates`` timed ones, and the modes take turns
``--rounds`` times so that drift of a shared machine spreads over all of them.
Reported per mode: the median update seconds (what ``ctl.update`` took:
pause, trainers' writes with their hashing, the engines' check, resume), the
median seconds of the check itself (``UpdateReport.integrity.seconds``:
engines hashing the ranges and the comparison), the trainers' hashing (the
slowest rank's ``hash_seconds``, inside its write stage), ranges and bytes
checked per update, and the overhead against ``off``. On a shared machine the
update seconds drift more than the modes differ; the two hashing columns are
the cost itself::

    wt bench integrity --updates 5 --rounds 2 --json integrity.json
    python -m actors.tools.cli.main bench integrity --help

The options are defined once, in :mod:`actors.tools.cli.main`; this module has only ``run``.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import ray
from rich.console import Console
from rich.table import Table

from actors.tools.demo.run_config import load_run_config
from scheduling import load_cluster_config
from weight_transfer.model.models import load_model_config

console = Console()


def _measure(base, trainers, replicas, policy, first_version: int, updates: int) -> list:
    from actors import WeightTransferController

    cfg = base.replace(integrity=policy)
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    try:
        ctl.setup()
        ctl.update(first_version)  # warm-up: the plan's first replay
        return [ctl.update(first_version + 1 + i) for i in range(updates)]
    finally:
        ctl.shutdown()


def run(config: Path, model: Path | None, modes: str, fraction: float, updates: int,
        rounds: int, json_path: Path | None) -> int:
    from actors import TransferConfig, launch_engines, launch_trainers

    run_cfg = load_run_config(config)
    base = TransferConfig(model=load_model_config(model or run_cfg.model_path),
                          cluster=load_cluster_config(run_cfg.cluster_path), fp8=run_cfg.fp8,
                          setup_timeout_s=600, update_timeout_s=600)
    policies = {m: {"mode": m, "fraction": fraction} if m == "sample" else {"mode": m}
                for m in modes.split(",")}
    for p in policies.values():  # fail before any actor starts
        base.replace(integrity=p)
    ray.init(address="local", num_cpus=run_cfg.ray.num_cpus, include_dashboard=False,
             log_to_driver=False)
    reports: dict[str, list] = {m: [] for m in policies}
    try:
        trainers, replicas = launch_trainers(base), launch_engines(base)
        version = 1
        for r in range(rounds):
            for mode, policy in policies.items():
                console.print(f"round {r + 1}/{rounds}: {mode}")
                reports[mode] += _measure(base, trainers, replicas, policy, version, updates)
                version += updates + 1
    finally:
        ray.shutdown()
    rows = _rows(reports)
    _print(rows, base)
    if json_path is not None:
        json_path.write_text(json.dumps({"model": base.model.name, "load": os.getloadavg(),
                                         "rows": rows}, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


def _rows(reports: dict[str, list]) -> list[dict]:
    rows = []
    off = statistics.median(r.seconds for r in reports["off"]) if "off" in reports else None
    for mode, reps in reports.items():
        median = statistics.median(r.seconds for r in reps)
        rows.append({
            "mode": mode, "updates": len(reps), "update_s": median,
            "update_s_all": [r.seconds for r in reps],
            "write_stage_s": statistics.median(r.stages.get("write", 0.0) for r in reps),
            "check_s": statistics.median(r.integrity.seconds for r in reps),
            "trainer_hash_s": statistics.median(max(x.transfer.hash_seconds for x in r.per_rank)
                                                for r in reps),
            "ranges": statistics.median(r.integrity.ranges for r in reps),
            "bytes_checked": statistics.median(r.integrity.bytes for r in reps),
            "bytes": reps[0].bytes, "ok": all(r.integrity.ok for r in reps),
            "overhead": None if off is None else median / off - 1.0,
        })
    return rows


def _print(rows: list[dict], base) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    table = Table(title=f"integrity checks: {base.model.name}, {rows[0]['bytes'] / 1e6:.1f} MB "
                        f"per update (load average {load})")
    for col in ("mode", "update s (median)", "vs off", "trainer hash s", "check s", "ranges",
                "MB checked", "ok"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        vs = "" if r["overhead"] is None else f"{100 * r['overhead']:+.1f}%"
        table.add_row(r["mode"], f"{r['update_s']:.3f}", vs, f"{r['trainer_hash_s']:.4f}",
                      f"{r['check_s']:.4f}",
                      f"{r['ranges']:.0f}", f"{r['bytes_checked'] / 1e6:.2f}", str(r["ok"]))
    console.print(table)
