"""Benchmark staging: per-update seconds of fresh piece buffers and of the staging arena.

The same plan is replayed ``--updates`` times in one run by every trainer rank
of the cluster config (in this process, each with its own simulated NIC), into
engine ranks that are separate processes, twice:

- ``fresh``: every prepared piece is a new tensor (allocated, first-touched,
  written from, freed), as before staging;
- ``staged``: pieces are written into each rank's arena, allocated, pre-faulted
  and registered once when the transfer is built (``setup`` column), and every
  update reuses it.

The first update of each mode is listed beside the later ones, because the
difference between a cold and a warm buffer is what staging removes from the
hot path. The NICs are uncapped by default (``--nic-gbps`` caps them): a capped
link hides memory costs behind the wire. Every update writes new weights and
both modes are checked byte for byte (sha256 of every engine region) after
their last update::

    wt bench staging --updates 5 --json staging.json
    python -m actors.tools.cli.main bench staging --help

The options are defined once, in :mod:`actors.tools.cli.main`; this module has only ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from actors.tools.bench.pipeline import NO_CHECKSUMS, expected_digests
from actors.tools.cli.sizes import parse_size
from actors.tools.testkit.harness import start_engine_targets
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.models import load_model_config
from weight_transfer.sender.executor import RankTransfer
from weight_transfer.sync.barrier import BarrierKey, StoreBarrier
from weight_transfer.transport.simnic.nic import SimNic

console = Console()
MODES = ("fresh", "staged")


@dataclasses.dataclass(slots=True)
class ModeResult:
    setup_seconds: float
    update_seconds: list[float]
    verified: bool

    def as_json(self) -> dict:
        later = self.update_seconds[1:]
        return {"setup_seconds": self.setup_seconds, "update_seconds": self.update_seconds,
                "first_seconds": self.update_seconds[0],
                "later_median_seconds": statistics.median(later) if later else None,
                "verified": self.verified}


def run_mode(plan, meta, states, targets, *, staged: bool, gbps, watermark) -> tuple[
        float, list[float]]:
    """(setup seconds, seconds of each update) of one mode; ``states[i]`` is update i's."""
    current: dict = {}
    store = dist.HashStore()
    world, key = [r.rank for r in meta.ranks], BarrierKey.new()
    nics, transfers = [], []
    try:
        start = time.perf_counter()
        for r in meta.ranks:
            nic = SimNic(owner=f"trainer{r.rank}", nic=r.nic, bandwidth_gbps=gbps)
            nics.append(nic)
            for t in targets:
                nic.connect(t.peer_info)
            transfers.append(RankTransfer(
                plan=plan.trainer_plan(r.rank), params=meta.params,
                get_param=lambda name: current[name], transport=nic, staging=staged,
                watermark_bytes=watermark, integrity=NO_CHECKSUMS,
                barrier=StoreBarrier(store, rank=r.rank, ranks=world, key=key, timeout_s=300)))
        setup = time.perf_counter() - start
        seconds = []
        for version, state in enumerate(states, start=1):
            current.clear()
            current.update(state)
            t0 = time.perf_counter()
            asyncio.run(_run_all(transfers, version))
            seconds.append(time.perf_counter() - t0)
        return setup, seconds
    finally:
        for t in transfers:
            t.close()
        for nic in nics:
            nic.close()


async def _run_all(transfers, version: int) -> None:
    await asyncio.gather(*(t.run(version=version) for t in transfers))


def run(model: Path, cluster_path: Path, fp8: bool, nic_gbps: float | None, watermark: str,
        updates: int, json_path: Path | None) -> int:
    cfg, cluster = load_model_config(model), load_cluster_config(cluster_path)
    cap = "uncapped" if nic_gbps is None else f"capped at {nic_gbps:g} GB/s"
    console.print(f"[bold]staging benchmark[/]: {cfg.name}, {cluster.name}, "
                  f"{'fp8' if fp8 else 'bf16'} engines, {updates} updates, trainer NICs {cap}")
    meta = trainer_meta_from_config(cfg, cluster)
    layout = engine_metas_from_config(cfg, cluster, fp8=fp8)
    lengths = [e.tensors[0].region.length for e in layout]
    states = [random_state_dict(cfg, seed=v) for v in range(1, updates + 1)]
    results: dict[str, ModeResult] = {}
    with contextlib.ExitStack() as stack:
        targets, engines = start_engine_targets(stack, layout)
        plan = compute_plan(meta, engines, cluster, model=cfg, fp8=fp8)
        plan.validate()
        want = expected_digests(cfg, states[-1], engines, lengths, fp8)
        for mode in MODES:
            for t in targets:
                t.fill(0)
            setup, seconds = run_mode(plan, meta, states, targets, staged=mode == "staged",
                                      gbps=nic_gbps, watermark=parse_size(watermark))
            ok = [t.digest(0, n) for t, n in zip(targets, lengths, strict=True)] == want
            results[mode] = ModeResult(setup, seconds, ok)
    _print(plan, results)
    if json_path is not None:
        json_path.write_text(json.dumps({
            **{m: r.as_json() for m, r in results.items()},
            "bytes": plan.bytes_total, "tasks": plan.num_tasks, "updates": updates}, indent=2))
    return 0 if all(r.verified for r in results.values()) else 1


def _print(plan, results: dict[str, ModeResult]) -> None:
    fresh, staged = results["fresh"], results["staged"]
    table = Table(title=f"{plan.bytes_total / 1e6:.1f} MB, {plan.num_tasks} tasks per update")
    for col in ("update", "fresh s", "staged s", "fresh / staged", "staged GB/s"):
        table.add_column(col, justify="right")
    table.add_row("setup", f"{fresh.setup_seconds:.3f}", f"{staged.setup_seconds:.3f}", "", "")
    for i, (f, s) in enumerate(zip(fresh.update_seconds, staged.update_seconds, strict=True)):
        table.add_row(str(i + 1), f"{f:.3f}", f"{s:.3f}", f"{f / s:.2f}x",
                      f"{plan.bytes_total / s / 1e9:.2f}")
    console.print(table)
    for mode, r in results.items():
        later = r.update_seconds[1:]
        med = f"{statistics.median(later):.3f} s" if later else "-"
        console.print(f"{mode}: first update {r.update_seconds[0]:.3f} s, later median {med}, "
                      f"bytes verified: {r.verified}")
