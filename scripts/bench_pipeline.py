"""Benchmark the trainer pipeline: the same plan run serially and pipelined, side by side.

Every trainer rank of the cluster config runs in this process (plain full
tensors stand in for gathered parameters), each with its own simulated NIC
capped at ``--nic-gbps``; every engine rank is a separate process holding its
registered region.

Why the default cap is low (0.1 GB/s): a real RDMA WRITE costs the sender's
CPU nothing, while a simnic WRITE is a memcpy on the same two cores that
quantize. Uncapped, both stages compete for the CPU and overlapping them
cannot help; with the link as the bottleneck, as on a real fabric where a GPU
prepares far faster than a NIC sends, the benchmark measures what pipelining
is for: preparing the next parameters while earlier writes are on the wire. Serial
mode runs one parameter at a time through h2d -> prepare -> write; pipelined
mode overlaps the stages under the memory watermark. Both runs are checked
byte for byte (sha256 of every engine region) against the reference loader::

    wt bench pipeline --model configs/models/bench_moe.yaml --fp8 --json out.json
    python -m scripts.cli bench pipeline --help  # without the console script

The options are defined once, in :mod:`scripts.cli`; this module has only ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.table import Table

from reference.loader import load_engine_shard
from reference.random_state import random_state_dict
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scripts.progress import command_console, emit_json, json_to_stdout, steps
from scripts.sizes import parse_size
from testkit.harness import start_engine_targets
from weight_transfer.barrier import StoreBarrier
from weight_transfer.executor import RankTransfer
from weight_transfer.models import load_model_config
from weight_transfer.prepare import as_bytes
from weight_transfer.transport.simnic import SimNic

ROOT = Path(__file__).resolve().parents[1]


def expected_digests(cfg, state, engines, lengths, fp8: bool) -> list[str]:
    """sha256 of each engine region as the reference loader lays it out (zeros elsewhere)."""
    out = []
    for e, length in zip(engines, lengths, strict=True):
        buf = torch.zeros(length, dtype=torch.uint8)
        want = load_engine_shard(cfg, state, e.shard, fp8=fp8)
        for t in e.tensors:
            buf[t.offset : t.offset + t.nbytes] = as_bytes(want[t.name])
        out.append(hashlib.sha256(buf.numpy()).hexdigest())
    return out


async def run_ranks(plan, trainer_meta, state, targets, *, serial, gbps, watermark) -> float:
    store = dist.HashStore()
    world = [r.rank for r in trainer_meta.ranks]
    nics, transfers = [], []
    try:
        for r in trainer_meta.ranks:
            nic = SimNic(owner=f"trainer{r.rank}", nic=r.nic, bandwidth_gbps=gbps)
            nics.append(nic)
            for t in targets:
                nic.connect(t.peer_info)
            transfers.append(RankTransfer(
                plan=plan.trainer_plan(r.rank), params=trainer_meta.params,
                get_param=state.__getitem__, transport=nic, serial=serial,
                watermark_bytes=watermark,
                barrier=StoreBarrier(store, rank=r.rank, ranks=world, timeout_s=300),
            ))
        start = time.perf_counter()
        await asyncio.gather(*(t.run(version=1) for t in transfers))
        return time.perf_counter() - start
    finally:
        for t in transfers:
            t.close()
        for nic in nics:
            nic.close()


def run(model: Path, cluster_path: Path, fp8: bool, nic_gbps: float, watermark: str,
        json_path: Path | None) -> int:
    console = command_console(json_path)
    cfg = load_model_config(model)
    cluster = load_cluster_config(cluster_path)
    console.print(f"[bold]pipeline benchmark[/]: {cfg.name}, {cluster.name}, "
                  f"{'fp8' if fp8 else 'bf16'} engines, trainer NICs capped at {nic_gbps:g} GB/s")
    state = random_state_dict(cfg, seed=0)
    trainer_meta = trainer_meta_from_config(cfg, cluster)
    layout = engine_metas_from_config(cfg, cluster, fp8=fp8)
    lengths = [e.tensors[0].region.length for e in layout]
    with contextlib.ExitStack() as stack:
        step = stack.enter_context(steps(console, "pipeline benchmark", 4,
                                         quiet=json_to_stdout(json_path)))
        step("start engine processes")
        targets, engines = start_engine_targets(stack, layout)
        step("plan and reference digests")
        plan = compute_plan(trainer_meta, engines, cluster, model=cfg, fp8=fp8)
        plan.validate()
        want = expected_digests(cfg, state, engines, lengths, fp8)
        results = {}
        for mode in ("serial", "pipelined"):
            step(f"run {mode}")
            for t in targets:
                t.fill(0)
            seconds = asyncio.run(run_ranks(plan, trainer_meta, state, targets,
                                            serial=mode == "serial", gbps=nic_gbps,
                                            watermark=parse_size(watermark)))
            ok = [t.digest(0, n) for t, n in zip(targets, lengths, strict=True)] == want
            results[mode] = {"seconds": seconds, "gbps": plan.bytes_total / seconds / 1e9,
                             "verified": ok}
    speedup = results["serial"]["seconds"] / results["pipelined"]["seconds"]
    table = Table(title=f"{plan.bytes_total / 1e6:.1f} MB, {plan.num_tasks} tasks, "
                        f"{len(trainer_meta.ranks)} trainer ranks -> {len(engines)} engine ranks")
    for col in ("mode", "seconds", "GB/s", "verified"):
        table.add_column(col, justify="right")
    for mode, r in results.items():
        table.add_row(mode, f"{r['seconds']:.3f}", f"{r['gbps']:.2f}", str(r["verified"]))
    console.print(table)
    console.print(f"speedup of pipelining: [bold]{speedup:.2f}x[/]")
    emit_json(json_path, {**results, "speedup": speedup, "bytes": plan.bytes_total,
                          "tasks": plan.num_tasks}, console)
    return 0 if all(r["verified"] for r in results.values()) else 1
