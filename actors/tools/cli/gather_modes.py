"""``wt simulate --gather both``: the gather-everything and shard-direct plans side by side.

For one model on one cluster, :func:`simulate_gather_modes` plans each gather
mode (``scheduling.compute_plan(..., gather=mode)``) and simulates it; the
table shows per mode the predicted update time, the binding stage, the NIC
lower bound (which moves: shard-direct sources are fixed by ownership), the
send-side balance and the share of bytes written from the owners' shards::

    rows = simulate_gather_modes(model_yaml, cluster_yaml)                # {mode: dict}
    rows = simulate_gather_modes(m, c, piece_scale=lambda plan: factors)  # e.g. deltas

``piece_scale`` is a factor per piece of the mode's plan (a callable given the
plan, since each mode cuts its own pieces) or one number for all: the bytes
each piece puts on the wire (:func:`scheduling.sim.simulate.with_piece_bytes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from actors.tools.cli.plan_cmd import build, summary
from actors.tools.cli.progress import command_console, emit_json, json_to_stdout, steps
from scheduling import simulate
from scheduling.build.direct import GATHER_MODES

Scale = Callable[[Any], np.ndarray] | float | None


def simulate_gather_modes(model: Path, cluster: Path, *, modes: tuple[str, ...] = ("full",
                          "shard_direct"), expert_naming: str = "per_expert",
                          gather_order: str = "interleaved", inflight: int | None = None,
                          resolution: float = 1e-5, nic_model: str = "events",
                          piece_scale: Scale = None,
                          step: Callable[[str], None] = lambda _: None,
                          megatron: str | None = None) -> dict[str, dict]:
    """Per gather mode: the plan summary (``wt plan``'s keys) and its simulation."""
    out = {}
    for mode in modes:
        p = build(model, cluster, expert_naming=expert_naming, gather_order=gather_order,
                  validate=False, step=step, gather=mode, megatron=megatron)
        step(f"simulate {mode}")
        scale = piece_scale(p.plan) if callable(piece_scale) else piece_scale
        t0 = time.perf_counter()
        r = simulate(p.plan, p.cluster, max_inflight=inflight, resolution=resolution,
                     nic_model=nic_model, piece_scale=scale)
        s = summary(p)
        s.update({"predicted_s": r.seconds, "lower_bound_s": r.lower_bound_seconds,
                  "barrier_lower_bound_s": r.barrier_lower_bound_seconds,
                  "efficiency": r.efficiency, "binding": r.binding,
                  "group_binding": list(r.group_binding), "stages": r.stage_seconds,
                  "nic_predicted_s": r.nic_seconds,
                  "simulate_seconds": time.perf_counter() - t0})
        out[mode] = s
    return out


ROWS = (
    ("predicted update", lambda s: f"[bold]{s['predicted_s']:.4f} s[/bold]"),
    ("binding stage", lambda s: s["binding"]),
    ("NIC lower bound", lambda s: f"{s['lower_bound_s']:.4f} s"),
    ("with barriers between groups", lambda s: f"{s['barrier_lower_bound_s']:.4f} s"),
    ("lower bound / predicted", lambda s: f"{s['efficiency']:.3f}"),
    ("busy per stage, critical rank", lambda s: ", ".join(
        f"{k} {v:.3f}" for k, v in s["stages"].items())),
    ("bytes written shard-direct", lambda s: f"{s['direct_bytes_fraction']:.1%}"),
    ("parameters gathered", lambda s: f"{s['gathered_params']:,} of {s['trainer_params']:,}"),
    ("send NICs max/mean", lambda s: f"{s['send_imbalance']:.4f}"),
    ("recv NICs max/mean", lambda s: f"{s['recv_imbalance']:.4f}"),
    ("pieces / tasks", lambda s: f"{s['pieces']:,} / {s['tasks']:,}"),
    ("time to plan / simulate", lambda s: f"{s['plan_seconds']:.1f} s / "
                                          f"{s['simulate_seconds']:.1f} s"),
)


def table(rows: dict[str, dict], title: str) -> Table:
    t = Table(title=title)
    t.add_column("")
    for mode in rows:
        t.add_column(mode, justify="right")
    for label, cell in ROWS:
        t.add_row(label, *(cell(s) for s in rows.values()))
    return t


def run_both(*, model: Path, cluster: Path, json_path: Path | None, expert_naming: str,
             gather_order: str, inflight: int | None, resolution: float,
             nic_model: str, megatron: str | None = None) -> int:
    console = command_console(json_path)
    try:
        with steps(console, "simulating", 2 + 4 * len(GATHER_MODES),
                   quiet=json_to_stdout(json_path)) as step:
            rows = simulate_gather_modes(model, cluster, expert_naming=expert_naming,
                                         gather_order=gather_order, inflight=inflight,
                                         resolution=resolution, nic_model=nic_model, step=step,
                                         megatron=megatron)
    except ValueError as err:
        console.print(f"[red]cannot plan:[/red] {err}")
        return 2
    first = next(iter(rows.values()))
    console.print(table(rows, f"gather modes: {first['model']} on {first['cluster']}"))
    emit_json(json_path, {"modes": rows}, console)
    return 0
