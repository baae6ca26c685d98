"""Where a delta (or dense) update's seconds go, for ``wt bench delta``: per phase, per
process, wall and CPU.

From one update's :class:`~actors.reports.UpdateReport` (the controller's steps:
``report.phases``, wall and the driver process's CPU; each trainer rank's run: wall, the
whole process's CPU, its prepare thread's wall and CPU), the trainer ranks' delta
counters (:class:`~weight_transfer.sender.delta.send.DeltaStats`: the FP8 source diff and
the encoding thread, wall and CPU) and the engines' applies
(:class:`~weight_transfer.engines.delta.DeltaApplied`, wall and CPU per engine rank)::

    acc = accounting(report, stats, applied)   # JSON-ready dict (one bench row's "phases")
    line_of(acc)                                # one console line
    table_of_phases(rows)                       # medians per (dtype, lr, mode), a rich table
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

CONTROLLER = ("directive", "begin", "transfer", "fence", "apply", "groups", "check", "end")


def _wc(wall: float, cpu: float) -> dict[str, float]:
    return {"wall": wall, "cpu": cpu}


def accounting(report: Any, stats: Sequence[dict], applied: Sequence[Any]) -> dict[str, Any]:
    """One update's seconds: ``controller`` (per step: wall, driver CPU), ``trainers`` (per
    rank: the run's wall and process CPU, prepare, FP8 source diff, encoding thread,
    barrier), ``engines`` (per engine rank: the apply's wall and CPU) and ``sums``."""
    trainers = []
    by_rank = {s.get("rank", i): s for i, s in enumerate(stats)}
    for r in report.per_rank:
        t, st = r.transfer, by_rank.get(r.rank, {})
        trainers.append({
            "rank": r.rank, "run": _wc(t.seconds, t.cpu_seconds),
            "prepare": _wc(t.prepare_seconds, t.prepare_cpu_seconds),
            "fp8_source": _wc(st.get("source_s", 0.0), st.get("source_cpu_s", 0.0)),
            "encode": _wc(st.get("encode_thread_s", 0.0), st.get("encode_thread_cpu_s", 0.0)),
            "barrier": _wc(t.barrier_seconds, 0.0)})
    engines = [{"owner": a.owner, "apply": _wc(a.seconds, a.cpu_seconds),
                "records": a.records} for a in applied]
    controller = {k: dict(report.phases.get(k, _wc(0.0, 0.0))) for k in CONTROLLER}
    sums = {
        "update_wall": report.seconds,
        "controller_cpu": sum(p["cpu"] for p in controller.values()),
        "trainer_cpu": sum(t["run"]["cpu"] for t in trainers),
        "trainer_prepare_cpu": sum(t["prepare"]["cpu"] for t in trainers),
        "trainer_encode_cpu": sum(t["encode"]["cpu"] for t in trainers),
        "engine_apply_cpu": sum(e["apply"]["cpu"] for e in engines),
        "slowest_rank_wall": max((t["run"]["wall"] for t in trainers), default=0.0),
    }
    return {"controller": controller, "trainers": trainers, "engines": engines, "sums": sums}


def line_of(acc: dict[str, Any]) -> str:
    """The controller's steps (wall) and the CPU summed per kind of process, on one line."""
    c, s = acc["controller"], acc["sums"]
    steps = " ".join(f"{k} {c[k]['wall']:.3f}" for k in CONTROLLER if c[k]["wall"] >= 0.0005)
    return (f"    wall s: {steps}; CPU s: trainers {s['trainer_cpu']:.3f} (prepare "
            f"{s['trainer_prepare_cpu']:.3f}, encode {s['trainer_encode_cpu']:.3f}), "
            f"engines' apply {s['engine_apply_cpu']:.3f}, controller {s['controller_cpu']:.3f}")


def _median(rows: Sequence[dict], get: Any) -> float:
    return statistics.median(get(r) for r in rows)


def median_phases(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of each controller step (wall, CPU), each trainer and engine
    figure (the slowest rank's wall, the CPU summed over ranks) and the sums."""
    accs = [r["phases"] for r in rows if r.get("phases")]
    if not accs:
        return {}
    out: dict[str, Any] = {"controller": {
        k: _wc(_median(accs, lambda a, k=k: a["controller"][k]["wall"]),
               _median(accs, lambda a, k=k: a["controller"][k]["cpu"])) for k in CONTROLLER}}
    for part in ("run", "prepare", "fp8_source", "encode", "barrier"):
        out[f"trainer_{part}"] = _wc(
            _median(accs, lambda a, p=part: max((t[p]["wall"] for t in a["trainers"]),
                                                default=0.0)),
            _median(accs, lambda a, p=part: sum(t[p]["cpu"] for t in a["trainers"])))
    out["engine_apply"] = _wc(
        _median(accs, lambda a: max((e["apply"]["wall"] for e in a["engines"]), default=0.0)),
        _median(accs, lambda a: sum(e["apply"]["cpu"] for e in a["engines"])))
    out["sums"] = {k: _median(accs, lambda a, k=k: a["sums"][k]) for k in accs[0]["sums"]}
    return out


def table_of_phases(runs: Sequence[dict[str, Any]]) -> Any:
    """One row per phase, one column per (dtype, lr, mode): the medians of
    :func:`median_phases` as ``wall / CPU`` seconds (the controller's steps: its wall and
    the driver's CPU; trainers and engines: the slowest rank's wall and the CPU summed
    over ranks)."""
    from rich.table import Table

    cols = [r for r in runs if r.get("phases")]
    table = Table(title="where an update's seconds go (medians; wall / CPU s)")
    table.add_column("phase (process)")
    for r in cols:
        table.add_column(f"{r['dtype']} {r['lr']:g} {r['mode']}", justify="right")
    rows = [(f"{k} (controller)", lambda m, k=k: m["controller"][k]) for k in CONTROLLER]
    rows += [(f"{label} (trainers)", lambda m, k=key: m[k])
             for label, key in (("run", "trainer_run"), ("prepare", "trainer_prepare"),
                                ("fp8 source diff", "trainer_fp8_source"),
                                ("encode", "trainer_encode"), ("barrier", "trainer_barrier"))]
    rows.append(("apply (engines)", lambda m: m["engine_apply"]))
    for label, get in rows:
        table.add_row(label, *(f"{get(r['phases'])['wall']:.3f} / {get(r['phases'])['cpu']:.3f}"
                               for r in cols))
    table.add_row("update (controller wall)",
                  *(f"{r['phases']['sums']['update_wall']:.3f}" for r in cols))
    return table
