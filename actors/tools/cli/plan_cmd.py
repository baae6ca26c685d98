"""``wt plan`` and ``wt simulate``: plan a model on a cluster from configs alone, and report.

``wt plan --model M.yaml --cluster C.yaml [--json out.json]`` builds trainer
and engine metadata from the configs (no weights), computes and validates the
plan, and prints tensors, tasks, bytes, bytes per NIC (send and receive),
imbalance, the NIC lower bound, time to plan and peak memory.

``wt simulate`` does the same, then runs the discrete-event model and prints
the predicted seconds beside the lower bound.

``--json -`` writes the JSON to standard output (the table goes to standard
error); ``wt simulate --png OUT`` draws the simulated timeline per trainer rank
(:mod:`scheduling.sim.timeline`), the way ``wt trace --png`` draws a measured one.
On a terminal a progress bar names the step being computed.

JSON keys (both): ``tasks``, ``bytes_total``, ``nic_imbalance`` (max/mean
bytes per NIC, the worse of the send and receive sides), ``lower_bound_s``,
``plan_seconds`` (metadata + plan, wall clock), ``trainer_layout`` (the trainer's
layout in one line), and more; ``simulate`` adds
``predicted_s``, ``barrier_lower_bound_s``, ``efficiency``, ``stages`` (stage ->
busy seconds on the critical rank), ``binding`` (the stage that took most of
them), ``group_binding`` (the same per mesh group), ``nic_predicted_s`` (the NIC
model alone), ``calibration`` (with ``--calibrate``: the constants and, with
``--check``, per bench configuration predicted and measured seconds) and
``sweep`` (with ``--sweep``: predicted seconds per watermark).
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from actors.tools.cli.progress import command_console, emit_json, json_to_stdout, steps
from scheduling import ClusterConfig, Plan, compute_plan, load_cluster_config, simulate
from scheduling.cluster.config import cluster_from_dict
from scheduling.cluster.megatron import parse_flag
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scheduling.flip import flip_seconds, shadow_need, sync_seconds
from scheduling.sim.simulate import lower_bounds
from weight_transfer.layout.shard_geometry import gc_paused
from weight_transfer.model.models import ModelConfig, load_model_config


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    plan: Plan
    cluster: ClusterConfig
    model: ModelConfig
    timings: dict[str, float]


def _gb(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.3f} {unit}"
    return f"{n:,.0f} B"


def with_megatron(cl: ClusterConfig, flag: str) -> ClusterConfig:
    """``cl`` with the trainer laid out as ``--megatron`` says: its FSDP fields dropped, and
    the host-to-device stage (Megatron keeps its weights on the GPU); errors name the file
    and the flag."""
    data = cl.model_dump(exclude_unset=True)
    for key in ("expert_parallel", "expert_mesh_layout", "replicate"):
        data["trainer"].pop(key, None)
    data.get("sim", {}).pop("h2d_gbps", None)
    data["trainer"]["megatron"] = parse_flag(flag)
    return cluster_from_dict(data, source=f"{cl.source or cl.name} with --megatron {flag!r}")


def build(model: Path, cluster: Path, *, expert_naming: str, gather_order: str,
          validate: bool, step: Callable[[str], None] = lambda _: None,
          gather: str = "shard_direct", megatron: str | None = None) -> Planned:
    """Load configs, build metadata, compute (and validate) the plan, timing each step.

    ``step(name)`` is called as each step starts (a progress bar); ``megatron``: a
    ``--megatron`` flag laying the trainer out instead of the cluster YAML's trainer layout.
    """
    step("read configs")
    cfg = load_model_config(model)
    cl = load_cluster_config(cluster)
    if megatron is not None:
        cl = with_megatron(cl, megatron)
    t0, c0 = time.perf_counter(), time.process_time()
    with gc_paused():  # one pause over both steps: no full GC pass between them
        step("trainer and engine metadata")
        tm = trainer_meta_from_config(cfg, cl, expert_naming=expert_naming)
        em = engine_metas_from_config(cfg, cl)
        t1 = time.perf_counter()
        step("compute the plan")
        plan = compute_plan(tm, em, cl, model=cfg, expert_naming=expert_naming,
                            gather_order=gather_order, gather=gather)
        # The plan lives until the command exits: keep later GC passes off its ~10^6 objects.
        gc.freeze()
    t2, c2 = time.perf_counter(), time.process_time()
    timings = {"metadata_seconds": t1 - t0, "compute_seconds": t2 - t1,
               "plan_seconds": t2 - t0, "plan_cpu_seconds": c2 - c0}
    if validate:
        step("validate every byte")
        plan.validate()
        timings["validate_seconds"] = time.perf_counter() - t2
    return Planned(plan=plan, cluster=cl, model=cfg, timings=timings)


def trainer_layout(cl: ClusterConfig) -> str:
    """The trainer's layout in one line: ``megatron tp=1 pp=16 vpp=2 ep=16 etp=1 dp=16``,
    ``fsdp ep=8`` or ``hsdp replicate=32 ep=32``."""
    t, world = cl.trainer, cl.trainer_world
    if (m := t.megatron) is not None:
        dp = world // (m.tensor_parallel * m.pipeline_parallel)
        return (f"megatron tp={m.tensor_parallel} pp={m.pipeline_parallel} "
                f"vpp={m.virtual_pipeline} ep={m.expert_parallel} "
                f"etp={m.expert_tensor_parallel} dp={dp}")
    kind = f"hsdp replicate={t.replicate}" if t.replicate > 1 else "fsdp"
    return f"{kind} ep={t.expert_parallel}"


def summary(p: Planned) -> dict[str, Any]:
    """The numbers both commands print and write."""
    plan = p.plan
    send, recv = plan.send_bytes(), plan.recv_bytes()
    send_tot, recv_tot = send.sum(axis=0), recv.sum(axis=0)

    def imbalance(x: np.ndarray) -> float:
        return float(x.max() / x.mean()) if x.size and x.mean() > 0 else 1.0

    total_lb, group_lb = lower_bounds(plan, p.cluster)
    nbytes = plan.task_nbytes()
    direct = float(nbytes[plan.task_direct()].sum() / nbytes.sum()) if plan.num_tasks else 0.0
    return {
        "gather": plan.gather,
        "direct_bytes_fraction": direct,
        "gathered_params": len(plan.fallback) if plan.gather == "shard_direct" else len(
            plan.params),
        "model": p.model.name or p.model.architecture,
        "cluster": p.cluster.name,
        "trainer_layout": trainer_layout(p.cluster),
        "trainer_params": len(plan.params),
        "tensors": sum(len(e.tensors) for e in plan.engines),
        "pieces": len(plan.pieces),
        "tasks": plan.num_tasks,
        "groups": plan.num_groups,
        "bytes_total": plan.bytes_total,
        "send_bytes_per_nic": {"min": int(send_tot.min()), "mean": float(send_tot.mean()),
                               "max": int(send_tot.max())},
        "recv_bytes_per_nic": {"min": int(recv_tot.min()), "mean": float(recv_tot.mean()),
                               "max": int(recv_tot.max())},
        "send_imbalance": imbalance(send_tot),
        "recv_imbalance": imbalance(recv_tot),
        "nic_imbalance": max(imbalance(send_tot), imbalance(recv_tot)),
        "group_send_imbalance": [imbalance(row) for row in send],
        "lower_bound_s": total_lb,
        "barrier_lower_bound_s": float(group_lb.sum()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **p.timings,
    }


def _table(s: dict[str, Any], extra: list[tuple[str, str]] = ()) -> Table:
    t = Table(title=f"plan: {s['model']} on {s['cluster']}", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [
        ("trainer layout", s["trainer_layout"]),
        ("trainer params / engine tensors", f"{s['trainer_params']:,} / {s['tensors']:,}"),
        ("pieces / tasks / mesh groups", f"{s['pieces']:,} / {s['tasks']:,} / {s['groups']}"),
        ("bytes total", _gb(s["bytes_total"])),
        ("gather mode / bytes written shard-direct",
         f"{s['gather']} / {s['direct_bytes_fraction']:.1%}"),
    ]
    for side in ("send", "recv"):
        b = s[f"{side}_bytes_per_nic"]
        rows.append((f"{side} bytes per NIC min / mean / max",
                     f"{_gb(b['min'])} / {_gb(b['mean'])} / {_gb(b['max'])}"))
        rows.append((f"{side} imbalance max/mean", f"{s[f'{side}_imbalance']:.4f}"))
    rows += [
        ("NIC lower bound", f"{s['lower_bound_s']:.4f} s"),
        ("with barriers between groups", f"{s['barrier_lower_bound_s']:.4f} s"),
        ("time to plan (metadata + plan)",
         f"{s['plan_seconds']:.2f} s ({s['metadata_seconds']:.2f} + {s['compute_seconds']:.2f})"),
    ]
    if "validate_seconds" in s:
        rows.append(("validate", f"{s['validate_seconds']:.2f} s"))
    rows.append(("peak memory (RSS)", f"{s['peak_rss_bytes'] / 2**30:.2f} GiB"))
    for row in (*rows, *extra):
        t.add_row(*row)
    return t


def run_plan(*, model: Path, cluster: Path, json_path: Path | None, expert_naming: str,
             gather_order: str, validate: bool, gather: str = "shard_direct",
             megatron: str | None = None) -> int:
    console = command_console(json_path)
    try:
        with steps(console, "planning", 4 if validate else 3,
                   quiet=json_to_stdout(json_path)) as step:
            p = build(model, cluster, expert_naming=expert_naming, gather_order=gather_order,
                      validate=validate, step=step, gather=gather, megatron=megatron)
    except ValueError as err:
        console.print(f"[red]cannot plan:[/red] {err}")
        return 2
    s = summary(p)
    console.print(_table(s))
    emit_json(json_path, s, console)
    return 0


SWEEP_WATERMARKS = (64 << 20, 256 << 20, 1 << 30, 4 << 30, 16 << 30)


def _calibrate(console, cluster: Path, check: bool, write_sim: Path | None) -> dict[str, Any]:
    """Measure this machine's constants; with ``check``, predicted vs measured bench runs."""
    from actors.tools.bench.calibrate import check as run_check
    from actors.tools.bench.calibrate import measure
    from actors.tools.bench.calibrate import write_sim as write
    from configs import BASE_DIR

    constants = measure(BASE_DIR, cluster)
    console.print("calibrated: " + ", ".join(f"{k}={v}" for k, v in constants.items()))
    if write_sim is not None:
        write(write_sim, constants)
        console.print(f"wrote the sim constants into {write_sim}")
    out: dict[str, Any] = {"constants": constants}
    if check:
        rows = run_check(BASE_DIR, cluster, constants)
        t = Table(title="simulator vs wt bench pipeline")
        for col in ("config", "predicted s", "measured s", "error", "binding"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(r["config"], f"{r['predicted_s']:.3f}", f"{r['measured_s']:.3f}",
                      f"{r['error']:+.0%}", r["binding"])
        console.print(t)
        out["configs"] = {r["config"]: r for r in rows}
    return out


def _sweep(p: Planned) -> list[dict[str, Any]]:
    """Predicted seconds (bound NIC model) per watermark."""
    out = []
    for wm in SWEEP_WATERMARKS:
        cl = p.cluster.model_copy(update={"sim": p.cluster.sim.model_copy(
            update={"watermark_bytes": wm})})
        r = simulate(p.plan, cl, nic_model="bound")
        out.append({"watermark_bytes": wm, "predicted_s": r.seconds, "binding": r.binding,
                    "over_bound": r.seconds / r.lower_bound_seconds - 1})
    return out


def flip_summary(p: Planned, transfer_s: float) -> dict[str, Any]:
    """Shadow mode on this cluster: the flip's stall per replica (a swap of the largest
    rank's weights at ``inference.device_copy_gbps``; ranks flip in parallel) beside the
    in-place stall (the whole transfer), whether the shadow fits the GPU memory, and the
    copy of live into the shadow that each sparse delta update makes while serving."""
    need = shadow_need(p.model, p.cluster, fp8=p.cluster.inference.fp8)
    gbps = p.cluster.inference.device_copy_gbps
    return {"rank_bytes": need.rank_bytes, "extra_bytes_per_rank": need.extra_bytes,
            "device_copy_gbps": gbps, "flip_s_per_replica": flip_seconds(need.rank_bytes, gbps),
            "delta_sync_s_per_replica": sync_seconds(need.rank_bytes, gbps),
            "in_place_stall_s_per_replica": transfer_s, "fits": need.fits,
            "memory": need.message()}


def flip_rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    flip = f["flip_s_per_replica"]
    stall = ("not modelled (inference.device_copy_gbps not set)" if flip is None else
             f"[bold]{flip * 1e3:.1f} ms[/bold] (swap of {_gb(f['rank_bytes'])} at "
             f"{f['device_copy_gbps']:g} GB/s) vs {f['in_place_stall_s_per_replica']:.3f} s "
             "in place (pause for the whole transfer)")
    sync = f["delta_sync_s_per_replica"]
    rows = [("shadow flip: stall per replica", stall),
            ("shadow memory per rank", f["memory"])]
    if sync is not None:
        rows.append(("shadow + deltas: live->shadow copy",
                     f"{sync * 1e3:.1f} ms per delta update while serving (not a pause)"))
    return rows


def run_simulate(*, model: Path, cluster: Path, json_path: Path | None, expert_naming: str,
                 gather_order: str, inflight: int | None, resolution: float,
                 png: Path | None = None, nic_model: str = "events", sweep: bool = False,
                 calibrate: bool = False, check: bool = False,
                 write_sim: Path | None = None, gather: str = "shard_direct",
                 delta: float | None = None, megatron: str | None = None) -> int:
    console = command_console(json_path)
    calibration = _calibrate(console, cluster, check, write_sim) if calibrate else None
    if png is not None:
        from actors.tools.cli.plots import MissingExtraError, import_pyplot

        try:
            import_pyplot()
        except MissingExtraError as err:
            console.print(f"[red]cannot draw {png}:[/red] {err}")
            return 2
    try:
        with steps(console, "simulating", 4, quiet=json_to_stdout(json_path)) as step:
            p = build(model, cluster, expert_naming=expert_naming, gather_order=gather_order,
                      validate=False, step=step, gather=gather, megatron=megatron)
            step("simulate the NICs")
            t0 = time.perf_counter()
            r = simulate(p.plan, p.cluster, max_inflight=inflight, resolution=resolution,
                         record=png is not None, nic_model=nic_model)
    except ValueError as err:
        console.print(f"[red]cannot plan:[/red] {err}")
        return 2
    s = summary(p)
    busy = np.array(list(r.per_nic_busy_seconds.values()))
    s.update({
        "predicted_s": r.seconds,
        "efficiency": r.efficiency,
        "group_seconds": list(r.group_seconds),
        "group_lower_bounds_s": list(r.group_lower_bounds),
        "nic_busy_s": {"min": float(busy.min()), "mean": float(busy.mean()),
                       "max": float(busy.max())},
        "events": r.events,
        "max_inflight": inflight or p.cluster.sim.max_inflight,
        "gather_order": gather_order,
        "simulate_seconds": time.perf_counter() - t0,
        "nic_predicted_s": r.nic_seconds,
        "stages": r.stage_seconds,
        "binding": r.binding,
        "group_binding": list(r.group_binding),
    })
    if calibration is not None:
        s["calibration"] = calibration
    s["flip"] = flip_summary(p, r.seconds)
    if delta is not None:
        s["delta"] = _delta(p, r, delta, inflight=inflight, resolution=resolution,
                            nic_model=nic_model)
    if sweep:
        s["sweep"] = _sweep(p)
    extra = [
        ("predicted transfer", f"[bold]{r.seconds:.4f} s[/bold]"),
        ("lower bound / predicted", f"{r.efficiency:.3f}"),
        ("per group (predicted / bound, binding)", ", ".join(
            f"{a:.4f}/{b:.4f} {c}" for a, b, c in zip(r.group_seconds, r.group_lower_bounds,
                                                      r.group_binding, strict=True))),
        ("NICs alone (discrete events)", f"{r.nic_seconds:.4f} s"),
        ("busy per stage, critical rank", ", ".join(
            f"{k} {v:.4f}" for k, v in r.stage_seconds.items())),
        ("binding stage", r.binding),
        *flip_rows(s["flip"]),
        ("simulation", f"{r.events:,} events in {s['simulate_seconds']:.1f} s"),
        *[(f"watermark {w['watermark_bytes'] / 2**20:,.0f} MiB",
           f"{w['predicted_s']:.4f} s (+{w['over_bound']:.1%}, {w['binding']})")
          for w in s.get("sweep", [])],
        *_delta_rows(s.get("delta")),
    ]
    console.print(_table(s, extra))
    emit_json(json_path, s, console)
    if png is not None:
        from actors.tools.cli.plots import draw_gantt
        from scheduling.sim.timeline import sim_timeline

        draw_gantt([sim_timeline(p.plan, r)], png)
        console.print(f"wrote {png}")
    return 0


def _delta(p, dense, fraction: float, **kw) -> dict:
    """``--delta FRACTION``: the same plan with sparse deltas (scheduling.sim.delta)."""
    from scheduling.sim.delta import simulate_delta

    r = simulate_delta(p.plan, p.cluster, fraction, max_inflight=kw["inflight"],
                       resolution=kw["resolution"], nic_model=kw["nic_model"])
    return {"fraction": fraction, "predicted_s": r.seconds, "binding": r.binding,
            "lower_bound_s": r.lower_bound_seconds, "stages": r.stage_seconds,
            "nic_predicted_s": r.nic_seconds, "dense_predicted_s": dense.seconds,
            "dense_lower_bound_s": dense.lower_bound_seconds,
            "speedup": dense.seconds / r.seconds if r.seconds > 0 else None}


def _delta_rows(d: dict | None) -> list[tuple[str, str]]:
    if d is None:
        return []
    return [
        (f"delta ({d['fraction']:.2%} changed): predicted",
         f"[bold]{d['predicted_s']:.4f} s[/bold] ({d['speedup']:.2f}x dense "
         f"{d['dense_predicted_s']:.4f} s)"),
        ("delta: binding stage", d["binding"]),
        ("delta: lower bound (NICs)", f"{d['lower_bound_s']:.4f} s (dense "
                                      f"{d['dense_lower_bound_s']:.4f} s)"),
        ("delta: busy per stage, critical rank", ", ".join(
            f"{k} {v:.4f}" for k, v in d["stages"].items())),
    ]
