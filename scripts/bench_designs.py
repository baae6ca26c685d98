"""``wt bench designs``: our point-to-point update beside the common designs, in one run.

One Ray run starts the demo's actors once (FSDP2 trainer ranks, reference-engine
TP replicas, the controller set up over simnic) and runs on them, with the
same NIC caps, ``--updates`` rounds of one update per design (interleaved, so
that a change in the machine's load hits every design alike):

* ``p2p`` (ours): ``controller.update(v)``, the static plan, pipelined;
* ``rank0``: gather each parameter, trainer rank 0 broadcasts it over gloo to
  every engine rank, which loads it (OpenRLHF, verl);
* ``rpc``: rank 0 calls each engine's ``update_weight(name, tensor)`` through Ray;
* ``bucketed``: rank 0 broadcasts fixed-size buckets, gathering the next
  while one is on the wire (checkpoint-engine style);
* ``rdt``: Ray Direct Transport: one bounded probe (:func:`rdt_outcome`), its
  outcome reported; not run as a design.

Baselines are in :mod:`actors.baselines`; their NIC model (a paced, full-duplex
NIC per process at the simnic cap, gloo's binomial tree counted) in
:mod:`actors.baseline_pacing`. Before every update all engine bytes are
zeroed; after each design's last update every engine tensor must equal the
reference loader's layout of the trainer's weights (the demo's byte check),
else the design is reported as failed. The median update time is reported
with GB/s, the ratio to ours and two bounds: the design's own busiest NIC
(bytes / cap), and the lower bound any design has (every engine rank must
receive its shard; the trainer NICs must send every replica's bytes), and the
median time of gathering every parameter without sending anything, the
trainer-side floor all these designs share. With
``--caps-off`` the designs run again uncapped, bounded by memcpy speed
(measured in the same run).

Why the default cap is 0.05 GB/s per NIC: the comparison is about designs
where the link binds, as on a GPU cluster, where a rank gathers over NVLink
(450 GB/s) and casts or quantizes in HBM (over 1000 GB/s) far faster than its
NIC sends (50 GB/s). Here the same work runs over gloo on 2 shared CPU cores:
ours spends about 1.5-4.5 s of CPU (prepare) per update of bench_dense,
depending on the load, so at 0.5 GB/s the CPU, not the link, set the pace
(ours 2.8 s against a 0.57 s bound). At 0.05 GB/s the link takes 5.7 s for
ours and the CPU hides behind it; the output says which binds for ours
(its slowest rank's write against prepare busy seconds). Every design gets
the same caps (baselines through :mod:`actors.baseline_pacing`)::

    wt bench designs --json designs.json --png designs.png
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch
from rich.table import Table

import actors.baselines as B
from actors.baseline_pacing import bucket_layout
from scripts.demo import connect_ray, start_fleet
from scripts.demo_checks import byte_problems
from scripts.demo_verify import _engine_digests, _trainer_digests
from scripts.progress import command_console, emit_json
from scripts.run_config import load_run_config, parse_run_config
from scripts.sizes import parse_size

DESIGNS = ("p2p", "rank0", "rpc", "bucketed", "rdt")
RDT_PROBE_TIMEOUT_S = 30.0


def rdt_outcome(timeout_s: float = RDT_PROBE_TIMEOUT_S) -> dict[str, Any]:
    """``rdt``: one bounded probe of Ray Direct Transport (:mod:`actors.rdt_probe`); the
    design itself would need RDT methods on the library's actors, which it does not have."""
    from actors.rdt_probe import probe_rdt

    probe = probe_rdt(64 << 20, timeout_s)
    if probe["ok"]:
        what = f"probe moved 64 MiB in {probe['seconds']:.3f} s"
    else:
        what = f"probe failed within {timeout_s:g} s ({probe['error']})"
    return {"ok": False, "seconds": [], "probe": probe,
            "error": f"not run as a design on Ray {ray.__version__}: {what}; the weight "
                     "update would need @ray.method(tensor_transport='gloo') methods on the "
                     "trainer and engine actors"}


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best of ``repeats`` single-thread copies of ``nbytes``, GB/s."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


class Bench:
    """The running fleet and the baselines' set-up on it."""

    def __init__(self, fleet: Any, bucket_bytes: int, timeout_s: float) -> None:
        self.fleet, self.timeout_s = fleet, timeout_s
        self.trainers = fleet.trainers
        self.engines = [a for r in fleet.replicas.values() for a in r]
        info = ray.get(self.trainers[0].__ray_call__.remote(B.trainer_params))
        self.params = info["params"]
        self.buckets = bucket_layout(self.params, bucket_bytes)
        self._get([e.__ray_call__.remote(B.engine_prepare, info["expert_naming"])
                   for e in self.engines])
        host, port = self._get(self.trainers[0].__ray_call__.remote(B.serve_group_store))
        size = 1 + len(self.engines)
        self._get([self.trainers[0].__ray_call__.remote(B.join_group, host, port, 0, size)]
                  + [e.__ray_call__.remote(B.join_group, host, port, i + 1, size)
                     for i, e in enumerate(self.engines)])
        self.want = next(d for d in self._get([
            t.__ray_call__.remote(_trainer_digests, fleet.engine_keys, fleet.config.engine_fp8)
            for t in self.trainers]) if d is not None)
        self.version = 0
        self.last_report: Any = None

    def _get(self, refs: Any) -> Any:
        return ray.get(refs, timeout=self.timeout_s)

    def set_caps(self, gbps: float | None) -> None:
        self._get([a.__ray_call__.remote(B.set_cap, gbps) for a in self.trainers + self.engines]
                  + [t.__ray_call__.remote(B.set_simnic_cap, gbps) for t in self.trainers])

    def nic_bytes(self) -> list[dict[str, int]]:
        return self._get([a.__ray_call__.remote(B.nic_bytes) for a in self.trainers[:1]
                          + self.engines])

    def refs(self, design: str) -> list[Any]:
        """Start one update of ``design`` on every actor."""
        t, e = self.trainers, self.engines
        if design == "rank0":
            plist = [p[:3] for p in self.params]
            return ([x.__ray_call__.remote(B.trainer_rank0) for x in t]
                    + [x.__ray_call__.remote(B.engine_rank0, plist) for x in e])
        if design == "bucketed":
            return ([x.__ray_call__.remote(B.trainer_bucketed, self.buckets) for x in t]
                    + [x.__ray_call__.remote(B.engine_bucketed, self.buckets) for x in e])
        if design == "rpc":
            return [x.__ray_call__.remote(B.trainer_rpc, e, self.timeout_s) for x in t]
        if design == "gather_only":
            return [x.__ray_call__.remote(B.trainer_gather_only) for x in t]
        raise ValueError(f"unknown design {design!r}")

    def update(self, design: str) -> float:
        self._get([e.__ray_call__.remote(B.engine_zero) for e in self.engines])
        start = time.perf_counter()
        if design == "p2p":
            self.version += 1
            self.last_report = self.fleet.controller.update(self.version)
        else:
            self._get(self.refs(design))
        return time.perf_counter() - start

    def verify(self) -> list[str]:
        got = {f"{name}/tp{r}": d for name, actors in self.fleet.replicas.items()
               for r, d in enumerate(self._get([a.__ray_call__.remote(_engine_digests)
                                                for a in actors]))}
        return byte_problems(self.want, got)


def busiest_nic_bytes(bench: Bench, design: str, before: list, after: list) -> int:
    """Bytes through the busiest NIC (either direction) in one update of ``design``."""
    if design == "p2p":
        s = bench.fleet.controller.summary
        return max([*s.send_nic_bytes.values(), *s.recv_nic_bytes.values()])
    return max(max(a[k] - b[k] for k in ("tx", "rx")) for a, b in zip(after, before,
                                                                        strict=True))


def run_pass(bench: Bench, designs: list[str], updates: int, cap: float | None,
             console: Any) -> dict[str, Any]:
    """``updates`` rounds, each design once per round (interleaved, so a change of the
    machine's load hits every design alike); each design verified after its last update."""
    bench.set_caps(cap)
    runnable = [d for d in designs if d != "rdt"]
    seconds: dict[str, list[float]] = {d: [] for d in runnable}
    busiest: dict[str, int] = {}
    out: dict[str, Any] = {}
    for round_ in range(updates):
        console.print(f"  round {round_ + 1}/{updates} "
                      f"({f'cap {cap:g} GB/s' if cap else 'uncapped'}) ...")
        for design in runnable:
            if design in out:  # failed earlier
                continue
            try:
                before = bench.nic_bytes()
                seconds[design].append(bench.update(design))
                busiest[design] = busiest_nic_bytes(bench, design, before, bench.nic_bytes())
                if round_ == updates - 1:
                    out[design] = _verified(bench, design, seconds[design], busiest[design])
            except Exception as exc:  # a design that fails is reported; the others go on
                out[design] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                               "seconds": seconds[design]}
    if "rdt" in designs and cap is not None:  # probed once, in the capped pass
        console.print("  rdt: probing Ray Direct Transport ...")
        out["rdt"] = rdt_outcome()
    return {d: out[d] for d in designs if d in out}


def _verified(bench: Bench, design: str, seconds: list[float], busiest: int) -> dict[str, Any]:
    problems = bench.verify()
    out = {"ok": not problems, "problems": problems, "seconds": seconds,
           "median_s": statistics.median(seconds), "busiest_nic_bytes": busiest}
    if design == "p2p" and bench.last_report is not None:
        out["stages_s"] = dict(bench.last_report.stages)  # busy s of the slowest rank
    return out


def p2p_binding(r: dict[str, Any]) -> dict[str, Any] | None:
    """Which of ours binds, from its slowest rank's busy seconds: the link (``write``) or
    the CPU path (``prepare``: gathers, cuts and casts on this host's cores)."""
    stages = r.get("stages_s")
    if not stages:
        return None
    write, prepare = stages.get("write", 0.0), stages.get("prepare", 0.0)
    what = "link" if write >= prepare else "cpu"
    return {"binding": what, "write_busy_s": write, "prepare_busy_s": prepare,
            "line": f"ours: write busy {write:.3f} s, prepare busy {prepare:.3f} s "
                    f"(slowest rank, last update) -> the {what} binds"}


def gather_floor(bench: Bench, updates: int) -> float:
    """Median seconds of gathering every parameter on every trainer rank, sending nothing:
    the part every design here shares (``full_tensor()`` over gloo between CPU actors)."""
    return statistics.median(bench.update("gather_only") for _ in range(updates))


def lower_bound_bytes(fleet: Any) -> int:
    """Any design: every engine rank receives its shard; trainer NICs send every replica."""
    s = fleet.controller.summary
    return max(max(s.recv_nic_bytes.values()),
               -(-s.bytes_total // max(1, len(s.send_nic_bytes))))


def table_of(results: dict, total: int, rate: float, bound_s: float, title: str) -> Table:
    table = Table(title=title)
    for col in ("design", "median s", "GB/s", "x ours", "own NIC bound s", "verified"):
        table.add_column(col, justify="right")
    ours = results.get("p2p", {}).get("median_s")
    for design, r in results.items():
        if "median_s" not in r:
            table.add_row(design, "-", "-", "-", "-", f"[red]no[/] ({r.get('error', '')[:60]})")
            continue
        ratio = f"{r['median_s'] / ours:.2f}" if ours else "-"
        table.add_row(design, f"{r['median_s']:.3f}", f"{total / r['median_s'] / 1e9:.3f}",
                      ratio, f"{r['busiest_nic_bytes'] / rate:.3f}",
                      "yes" if r["ok"] else "[red]FAILED[/]")
    table.caption = f"lower bound {bound_s:.3f} s"
    return table


def draw_png(doc: dict, path: Path) -> None:
    from scripts.plots import import_pyplot

    plt = import_pyplot()
    passes = [k for k in ("caps_on", "caps_off") if k in doc["passes"]]
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4), squeeze=False)
    for ax, key in zip(axes[0], passes, strict=True):
        p = doc["passes"][key]
        names = [d for d, r in p["results"].items() if "median_s" in r]
        ax.bar(names, [p["results"][d]["median_s"] for d in names],
               color=["tab:green" if d == "p2p" else "tab:gray" for d in names])
        ax.axhline(p["lower_bound_s"], color="tab:red", ls="--", label="lower bound")
        if "gather_only_s" in p:
            ax.axhline(p["gather_only_s"], color="tab:blue", ls=":",
                       label="gather only (shared by all)")
        ax.set_ylabel("median seconds per update")
        ax.set_title(f"{doc['model']}: {key.replace('_', ' ')}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_config(config: Path, model: Path | None, cap: float | None) -> Any:
    data = load_run_config(config).model_dump(by_alias=True)
    if model is not None:
        data["model"] = str(model)
    data["transfer"]["transport"] = "simnic"
    data["transfer"]["simnic"]["bandwidth_gbps"] = cap
    return parse_run_config(data, source=f"{config} (wt bench designs)")


def run(*, config: Path, model: Path | None, nic_gbps: float, updates: int, designs: str,
        bucket: str, caps_off: bool, timeout_s: float, json_path: Path | None,
        png: Path | None) -> int:
    console = command_console(json_path)
    chosen = [d.strip() for d in designs.split(",") if d.strip()]
    bad = sorted(set(chosen) - set(DESIGNS))
    if bad or "p2p" not in chosen:
        console.print(f"[bold red]error:[/] --designs {designs!r}: unknown {bad} or no p2p "
                      f"(choose from {', '.join(DESIGNS)}; p2p is the reference)")
        return 2
    if png is not None:
        from scripts.plots import MissingExtraError, import_pyplot
        try:
            import_pyplot()
        except MissingExtraError as exc:
            console.print(f"[bold red]error:[/] {exc}")
            return 2
    run_cfg = _run_config(config, model, nic_gbps)
    started = connect_ray(run_cfg)
    fleet = None
    try:
        fleet = start_fleet(run_cfg)
        console.print(fleet.describe())
        bench = Bench(fleet, parse_size(bucket), timeout_s)
        mem = memcpy_gbps()
        total, bound_bytes = fleet.controller.summary.bytes_total, lower_bound_bytes(fleet)
        doc: dict[str, Any] = {"model": fleet.config.model.name, "bytes": total,
                               "nic_gbps": nic_gbps, "memcpy_gbps": mem, "updates": updates,
                               "passes": {}}
        for key, cap, rate in (("caps_on", nic_gbps, nic_gbps * 1e9),
                               ("caps_off", None, mem * 1e9))[: 2 if caps_off else 1]:
            results = run_pass(bench, chosen, updates, cap, console)
            floor = gather_floor(bench, updates)
            doc["passes"][key] = {"results": results, "lower_bound_s": bound_bytes / rate,
                                  "bound": "NIC cap" if cap else "memcpy",
                                  "gather_only_s": floor}
            console.print(f"gather only (every design's trainer-side floor): {floor:.3f} s")
            binding = p2p_binding(results.get("p2p", {}))
            if binding is not None:
                doc["passes"][key]["p2p_binding"] = binding
                console.print(binding["line"])
            console.print(table_of(results, total, rate, bound_bytes / rate,
                                   f"{doc['model']}, {total / 1e9:.3f} GB per update, "
                                   f"{key.replace('_', ' ')}"))
    finally:
        if fleet is not None:
            fleet.close()
        if started:
            ray.shutdown()
    on = doc["passes"]["caps_on"]
    doc["results"] = {d: r.get("median_s") for d, r in on["results"].items()}
    doc["lower_bound_s"] = on["lower_bound_s"]
    emit_json(json_path, doc, console)
    if png is not None:
        draw_png(doc, png)
        console.print(f"wrote {png}")
    failed = [d for d, r in on["results"].items() if not r["ok"] and d != "rdt"]
    if failed:
        console.print(f"[bold red]designs that failed:[/] {', '.join(failed)}")
    return 1 if failed else 0
