"""``wt bench designs``: our point-to-point update beside the common designs, in one run.

One Ray run starts the demo's actors once (FSDP2 trainer ranks, reference-engine
TP replicas, the controller set up over simnic) and runs on them, with the
same NIC caps, ``--updates`` rounds of one update per design (interleaved, so
that a change in the machine's load hits every design alike):

* ``p2p`` (ours): ``controller.update(v)``, the static plan, pipelined, with
  shard-direct pieces (``TransferConfig.gather="shard_direct"``: a parameter
  whose pieces its owners' shards cover is written from them, no gather);
* ``p2p_staged`` (ours before zero-copy sources): ``p2p`` with ``source="snapshot"``,
  every piece copied into the staging arena before its WRITE; the JSON gives, for
  each of ours, the bytes copied per update and the peak temporary bytes per rank;
* ``p2p_gather`` (ours before shard-direct pieces): the same with
  ``gather="full"``, every parameter gathered first (a second controller on the
  same actors; whichever of the two runs is set up again, untimed, first);
* ``rank0``: gather each parameter, trainer rank 0 broadcasts it over gloo to
  every engine rank, which loads it (OpenRLHF, verl);
* ``rpc``: rank 0 calls each engine's ``update_weight(name, tensor)`` through Ray;
* ``bucketed``: rank 0 broadcasts fixed-size buckets, gathering the next
  while one is on the wire (checkpoint-engine style);
* ``rdt``: Ray Direct Transport: one bounded probe (:func:`rdt_outcome`), its
  outcome reported; not run as a design;
* ``native`` (``--trainer deepspeed`` only, its default with ``p2p``): OpenRLHF's own
  weight sync on DeepSpeed ZeRO-3 trainer actors: per parameter
  ``deepspeed.zero.GatheredParameters``, trainer rank 0 broadcasts it, every engine rank
  loads it (``rank0``'s path; on a ZeRO-3 trainer every baseline gathers that way).
  The JSON names the trainer and gives ours' direct and gathered bytes (``p2p_plan``).
  With ``--trainer megatron`` it is slime's own: per parameter a TP all-gather, the
  Megatron tensor converted to Hugging Face tensors (QKV and fc1 split), trainer rank 0
  broadcasts each, every engine rank loads it (PP 1: the demo's Megatron trainers).

Baselines are in :mod:`actors.tools.bench.baselines`; their NIC model (a paced, full-duplex
NIC per process at the simnic cap, gloo's binomial tree counted) in
:mod:`actors.tools.bench.pacing`. Before every update all engine bytes are
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
the same caps (baselines through :mod:`actors.tools.bench.pacing`)::

    wt bench designs --json designs.json --png designs.png
    wt bench designs --engine vllm --json designs_vllm.json --png designs_vllm.png

The per-engine side (start the fleet, zero, the baselines' engine side, the
byte check) is a :class:`actors.tools.bench.designs.fleet.DesignBench`: the
reference engine's in that module, real vLLM's in
:mod:`actors.tools.bench.designs.vllm` (``--engine vllm``: the vLLM demo's fleet,
vLLM's own ``load_weights`` in its workers, checked against vLLM's
``load_weights`` of the trainers' weights). The table and the chart are in
:mod:`actors.tools.bench.designs.report`.

``run(..., fleet=fleet)`` runs on a fleet the caller started (the tests share one vLLM
fleet with ``wt bench stall``) and leaves it usable: the versions of ours go on above the
fleet controller's (:mod:`actors.tools.bench.caller_fleet`), a second controller of ours
is shut down after and the fleet's own set up again if the other replaced its plan. The
NIC caps of the last pass stay, and the engines hold what the last design wrote (each
design's last update is verified to leave every engine byte equal to the trainers'
weights).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from actors.engine_registry import engine_names, engine_spec
from actors.tools.bench.caller_fleet import check_fleet, next_version
from actors.tools.bench.designs.fleet import P2P_MODES, DesignBench, mode_of
from actors.tools.bench.designs.report import draw_png, p2p_binding, table_of
from actors.tools.cli.progress import command_console, emit_json
from actors.tools.cli.sizes import parse_size
from actors.tools.demo.fleet import fleet_session
from actors.tools.demo.run_config import load_run_config, parse_run_config
from actors.tools.demo.trainers import DEFAULT_TRAINER, check_trainer
from actors.tools.engine_tools import engine_tool, has_tool

DESIGNS = ("p2p", "p2p_staged", "p2p_gather", "rank0", "rpc", "bucketed", "rdt", "native")
# the designs run when none are named, per trainer (``--trainer``)
DEFAULT_DESIGNS = {"fsdp2": "p2p,p2p_staged,p2p_gather,rank0,rpc,bucketed,rdt",
                   "deepspeed": "p2p,native", "megatron": "p2p,native"}
# designs that only trainers of these names run (native: the framework's own weight sync,
# OpenRLHF's on DeepSpeed, slime's on Megatron)
TRAINER_DESIGNS = {"native": ("deepspeed", "megatron")}
RDT_PROBE_TIMEOUT_S = 30.0


def rdt_outcome(timeout_s: float | None = None) -> dict[str, Any]:
    """``rdt``: one bounded probe of Ray Direct Transport (:mod:`actors.tools.bench.rdt_probe`); the
    design itself would need RDT methods on the library's actors, which it does not have.
    ``timeout_s`` defaults to :data:`RDT_PROBE_TIMEOUT_S`."""
    from actors.tools.bench.rdt_probe import probe_rdt

    timeout_s = RDT_PROBE_TIMEOUT_S if timeout_s is None else timeout_s

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


def busiest_nic_bytes(bench: DesignBench, design: str, before: list, after: list) -> int:
    """Bytes through the busiest NIC (either direction) in one update of ``design``."""
    if design in P2P_MODES:
        s = bench.controllers[design].summary
        return max([*s.send_nic_bytes.values(), *s.recv_nic_bytes.values()])
    return max(max(a[k] - b[k] for k in ("tx", "rx")) for a, b in zip(after, before,
                                                                        strict=True))


def run_pass(bench: DesignBench, designs: list[str], updates: int, cap: float | None,
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


def _verified(bench: DesignBench, design: str, seconds: list[float],
              busiest: int) -> dict[str, Any]:
    problems = bench.verify()
    out = {"ok": not problems, "problems": problems, "seconds": seconds,
           "median_s": statistics.median(seconds), "busiest_nic_bytes": busiest}
    if design in P2P_MODES and bench.last_report is not None:
        out.update(p2p_numbers(bench.last_report))
    return out


def p2p_numbers(report: Any) -> dict[str, Any]:
    """Of one update of ours: the slowest rank's busy seconds per stage, the bytes the
    ranks copied into staging before their WRITEs (the rest went zero-copy), the most
    temporary bytes one rank held (its watermark's peak) and each rank's source."""
    ranks = [r.transfer for r in report.per_rank]
    return {"stages_s": dict(report.stages),
            "bytes_copied": sum(t.bytes_planned - t.zero_copy_bytes for t in ranks),
            "zero_copy_bytes": sum(t.zero_copy_bytes for t in ranks),
            "peak_temp_bytes_per_rank": max((t.watermark_peak for t in ranks), default=0),
            "sources": sorted({t.source for t in ranks})}


def shard_direct_speedup(results: dict[str, Any]) -> float | None:
    """p2p_gather's median over p2p's, where both ran and verified."""
    a, b = results.get("p2p", {}), results.get("p2p_gather", {})
    if not (a.get("ok") and b.get("ok")):
        return None
    return b["median_s"] / a["median_s"]


def zero_copy_gain(results: dict[str, Any]) -> dict[str, Any] | None:
    """p2p (zero-copy where it may) against p2p_staged (every piece staged), where both ran
    and verified: the ratios of their medians and of their slowest ranks' prepare busy
    seconds, and the bytes each copied per update."""
    a, b = results.get("p2p", {}), results.get("p2p_staged", {})
    if not (a.get("ok") and b.get("ok")):
        return None
    prep_a, prep_b = (r.get("stages_s", {}).get("prepare", 0.0) for r in (a, b))
    return {"speedup": b["median_s"] / a["median_s"],
            "prepare_speedup": prep_b / prep_a if prep_a > 0 else None,
            "bytes_copied": {"p2p": a.get("bytes_copied"), "p2p_staged": b.get("bytes_copied")}}


def gather_floor(bench: DesignBench, updates: int) -> float:
    """Median seconds of gathering every parameter on every trainer rank, sending nothing:
    the part every design here shares (``full_tensor()`` over gloo between CPU actors)."""
    return statistics.median(bench.update("gather_only") for _ in range(updates))


def lower_bound_bytes(fleet: Any) -> int:
    """Any design: every engine rank receives its shard; trainer NICs send every replica."""
    s = fleet.controller.summary
    return max(max(s.recv_nic_bytes.values()),
               -(-s.bytes_total // max(1, len(s.send_nic_bytes))))


def bench_run_config(config: Path, model: Path | None, cap: float | None, engine: str,
                     trainer: str | None = None) -> Any:
    """The run config the bench starts its fleet with: ``config`` with ``model`` and
    ``trainer`` (when given) and ``engine``, over simnic capped at ``cap`` GB/s."""
    data = load_run_config(config).model_dump(by_alias=True)
    if model is not None:
        data["model"] = str(model)
    if trainer is not None:
        data["trainer"] = trainer
    data["engine"] = engine
    transfer = data["transfer"]
    options = transfer.get("transport_options") if transfer["transport"] == "simnic" else None
    transfer["transport"] = "simnic"  # the file's simnic options kept, the cap set
    transfer["transport_options"] = {**(options or {}), "bandwidth_gbps": cap}
    return parse_run_config(data, source=f"{config} (wt bench designs)")


def _bench_class(engine: str) -> tuple[Any, type[DesignBench]]:
    """(start_fleet, the bench class) of ``engine``: its hooks ``start_fleet`` and ``bench``
    (:mod:`actors.tools.engine_tools`)."""
    name = engine_spec(engine).name  # ValueError listing the registered engines
    return engine_tool(name, "start_fleet"), engine_tool(name, "bench")


def _check_args(console: Any, engine: str, chosen: list[str], designs: str,
                png: Path | None, trainer: str = DEFAULT_TRAINER) -> bool:
    try:
        check_trainer(trainer)
    except ValueError as exc:
        console.print(f"[bold red]error:[/] --trainer: {exc}")
        return False
    bad = sorted(set(chosen) - set(DESIGNS))
    wrong = sorted(d for d in chosen if trainer not in TRAINER_DESIGNS.get(d, (trainer,)))
    if wrong:
        console.print(f"[bold red]error:[/] --designs {designs!r}: "
                      + "; ".join(f"{d} runs with --trainer "
                                  + " or ".join(TRAINER_DESIGNS[d]) for d in wrong)
                      + f", not {trainer}")
        return False
    benches = [n for n in engine_names() if has_tool(n, "bench")]
    if engine not in benches:
        console.print(f"[bold red]error:[/] --engine {engine!r}: choose from "
                      f"{', '.join(benches)}")
        return False
    if bad or "p2p" not in chosen:
        console.print(f"[bold red]error:[/] --designs {designs!r}: unknown {bad} or no p2p "
                      f"(choose from {', '.join(DESIGNS)}; p2p is the reference)")
        return False
    if png is not None:
        from actors.tools.cli.plots import MissingExtraError, import_pyplot
        try:
            import_pyplot()
        except MissingExtraError as exc:
            console.print(f"[bold red]error:[/] {exc}")
            return False
    return True


def measure(bench: DesignBench, chosen: list[str], updates: int, nic_gbps: float,
            caps_off: bool, console: Any) -> dict[str, Any]:
    """Every pass (caps on; caps off too with ``caps_off``) on a running bench; the
    results document without its top-level summary."""
    fleet = bench.fleet
    mem = memcpy_gbps()
    total, bound_bytes = fleet.controller.summary.bytes_total, lower_bound_bytes(fleet)
    doc: dict[str, Any] = {"engine": bench.engine, "model": fleet.config.model.name,
                           "bytes": total, "nic_gbps": nic_gbps, "memcpy_gbps": mem,
                           "updates": updates, "passes": {}}
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
                               f"{doc['model']} ({bench.engine} engine), {total / 1e9:.3f} GB "
                               f"per update, {key.replace('_', ' ')}"))
        ratio = shard_direct_speedup(results)
        if ratio is not None:
            doc["passes"][key]["shard_direct_speedup"] = ratio
            console.print(f"shard-direct (p2p) against gather-everything (p2p_gather): "
                          f"{ratio:.2f}x faster")
        gain = zero_copy_gain(results)
        if gain is not None:
            doc["passes"][key]["zero_copy"] = gain
            prep = gain["prepare_speedup"]
            console.print(f"zero-copy (p2p) against every piece staged (p2p_staged): "
                          f"{gain['speedup']:.2f}x faster, prepare "
                          f"{'-' if prep is None else f'{prep:.2f}x'}; bytes copied per "
                          f"update {gain['bytes_copied']}")
    return doc


def _config_trainer(console: Any, config: Path) -> str | None:
    """The trainer the run config ``config`` names (None, printed, when it is bad)."""
    try:
        return load_run_config(config).trainer
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return None


def bench_fleet(start_fleet: Callable[[Any], Any], run_cfg: Any,
                fleet: Any = None) -> contextlib.AbstractContextManager[Any]:
    """``fleet`` as given (the caller's, left running), or ``start_fleet(run_cfg)`` on Ray
    (joined, or started for the block), closed after the block."""
    return fleet_session(run_cfg, fleet, start=start_fleet)


def release(bench: DesignBench) -> None:
    """What the bench holds beyond the fleet released: its files, and the second
    controller of ours (``p2p_gather``'s, or ``p2p``'s) shut down."""
    bench.close()
    for ctl in bench.controllers.values():
        if ctl is not bench.fleet.controller:
            ctl.shutdown()


def hand_back(bench: DesignBench) -> None:
    """The fleet's own controller set up again where the other one of ours replaced its
    plan in the trainers: the caller's fleet goes on with it."""
    bench.controller(mode_of(bench.fleet.config))  # no set-up if it ran last


def run(*, config: Path, model: Path | None, nic_gbps: float, updates: int,
        designs: str | None, bucket: str, caps_off: bool, timeout_s: float,
        json_path: Path | None, png: Path | None, engine: str = "reference",
        fleet: Any = None, trainer: str | None = None) -> int:
    """``wt bench designs``; ``fleet``: run on these actors (the caller's, left running;
    see the module docstring) instead of starting the engine's fleet from ``config`` and
    ``model``; ``trainer``: the trainer actors (a name of
    :mod:`actors.tools.demo.trainers`; default: the run config's); ``designs``: None for
    the trainer's :data:`DEFAULT_DESIGNS`."""
    console = command_console(json_path)
    name = trainer or (fleet.run.trainer if fleet is not None else
                       _config_trainer(console, config))
    if name is None:
        return 2
    designs = DEFAULT_DESIGNS.get(name, "p2p") if designs is None else designs
    chosen = [d.strip() for d in designs.split(",") if d.strip()]
    if not _check_args(console, engine, chosen, designs, png, name):
        return 2
    if fleet is not None:
        check_fleet(fleet, engine, "wt bench designs")
    start_fleet, bench_cls = _bench_class(engine)
    run_cfg = bench_run_config(config, model, nic_gbps, engine, trainer)
    with bench_fleet(start_fleet, run_cfg, fleet) as active:
        console.print(active.describe())
        bench = bench_cls(active, parse_size(bucket), timeout_s)
        try:
            bench.version = next_version(active.controller) - 1  # 0 on a fleet just started
            doc = measure(bench, chosen, updates, nic_gbps, caps_off, console)
            summary = active.controller.summary  # ours: what goes direct, what is gathered
            doc["p2p_plan"] = {"direct_bytes": summary.direct_bytes,
                               "gathered_bytes": summary.gathered_bytes}
        finally:
            release(bench)
        if fleet is not None:
            hand_back(bench)
    if name != DEFAULT_TRAINER:  # the default trainer's JSON stays as it was
        doc["trainer"] = name
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
