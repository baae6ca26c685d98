"""Benchmark the trainer pipeline: the same plan run serially and pipelined, side by side.

Every trainer rank of the cluster config runs in this process (plain full
tensors stand in for gathered parameters), each with its own simulated NIC
capped at ``--nic-gbps``; every engine rank is a separate process holding its
registered region. Serial mode runs one gather bucket at a time through h2d ->
prepare -> write (one WRITE at a time); pipelined mode overlaps the stages
under the memory watermark. Each round runs both modes (interleaved, so a
change of load hits both); the report is the median of ``--repeats`` rounds,
and every run is checked byte for byte (sha256 of every engine region) against
the reference loader.

The defaults, and why (pipelining pays where the link is the bottleneck, as on
a fabric where a GPU prepares far faster than its NIC sends):

* ``configs/models/bench_dense.yaml`` with FP8 engines: a 286 M-parameter Llama
  in one mesh group. bench_moe has two groups with a barrier between them, and
  its expert group is all FP8 quantization with few bytes to send, so there
  the CPU binds whatever the cap;
* ``configs/clusters/bench_pipeline.yaml``: 2 trainer ranks, one per core of
  this 2-core host, as each real rank has its own GPU. With more ranks than
  cores, one rank's serial prepare runs while another rank writes, and serial
  against pipelined would measure CPU sharing between ranks, not overlap within one;
* ``--nic-gbps 0.1``: a simnic WRITE is a memcpy on the same cores that
  quantize, while a real RDMA WRITE costs the sender's CPU nothing; at 0.1 GB/s
  the link takes 3.5 s per rank, at least a rank's prepare work (3.3 s
  measured at load average 10-14, less on a quiet host), so the link binds
  and the prepare work is there to hide;
* ``--bucket-bytes 16M``: the pipeline's items are gather buckets; with the
  executor's default 64 MiB the first prepare and the last write of a group
  overlap nothing for longer.

The output says which binds: the link bound (the busiest trainer NIC's bytes
at the cap) against the busiest rank's prepare work in the serial run::

    wt bench pipeline --json out.json          # bench_dense, FP8, the defaults above
    python -m actors.tools.cli.main bench pipeline --help  # without the console script

The options are defined once, in :mod:`actors.tools.cli.main`; this module has only ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.table import Table

from actors.tools.cli.progress import command_console, emit_json, json_to_stdout, steps
from actors.tools.cli.sizes import parse_size
from actors.tools.testkit.harness import start_engine_targets
from configs import BASE_DIR
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.integrity.checksums import IntegrityPolicy
from weight_transfer.model.models import load_model_config
from weight_transfer.sender.executor import RankTransfer
from weight_transfer.sender.gather import DEFAULT_BUCKET_BYTES
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.sync.barrier import BarrierKey, StoreBarrier
from weight_transfer.transport.simnic.nic import SimNic

ROOT = BASE_DIR

# What the benches time is the transfer: no checksums (the library's default hashes a tenth
# of the WRITEs; docs/performance.md measures that cost apart).
NO_CHECKSUMS = IntegrityPolicy(mode="off")


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


async def run_ranks(plan, trainer_meta, state, targets, *, serial, gbps, watermark,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, reports: list | None = None) -> float:
    """Seconds of one transfer by every trainer rank (in this process); each rank's
    :class:`TransferReport` is appended to ``reports`` if given."""
    store = dist.HashStore()
    world, key = [r.rank for r in trainer_meta.ranks], BarrierKey.new()
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
                watermark_bytes=watermark, bucket_bytes=bucket_bytes, integrity=NO_CHECKSUMS,
                barrier=StoreBarrier(store, rank=r.rank, ranks=world, key=key, timeout_s=300),
            ))
        start = time.perf_counter()
        done = await asyncio.gather(*(t.run(version=1) for t in transfers))
        seconds = time.perf_counter() - start
        if reports is not None:
            reports.extend(done)
        return seconds
    finally:
        for t in transfers:
            t.close()
        for nic in nics:
            nic.close()


def busy(report, stage: str) -> float:
    """Seconds one rank's items spent in ``stage`` (the union of their spans)."""
    spans = sorted((s.start, s.end) for s in report.spans if s.stage == stage)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _mode_result(mode: str, seconds: list[float], reports: list, bytes_total: int,
                 verified: bool) -> dict:
    med = statistics.median(seconds)
    return {"seconds": med, "gbps": bytes_total / med / 1e9, "verified": verified,
            "runs": seconds,
            # the CPU work of the busiest rank: gathers stand-ins, cuts, casts, FP8
            "prepare_s": statistics.median(max(busy(r, "prepare") for r in rs)
                                           for rs in reports)}


def run(model: Path, cluster_path: Path, fp8: bool, nic_gbps: float, watermark: str,
        json_path: Path | None, repeats: int = 3, bucket_bytes: str = "16M") -> int:
    console = command_console(json_path)
    cfg = load_model_config(model)
    cluster = load_cluster_config(cluster_path)
    console.print(f"[bold]pipeline benchmark[/]: {cfg.name}, {cluster.name}, "
                  f"{'fp8' if fp8 else 'bf16'} engines, trainer NICs capped at {nic_gbps:g} GB/s, "
                  f"median of {repeats} runs per mode (interleaved)")
    state = random_state_dict(cfg, seed=0)
    trainer_meta = trainer_meta_from_config(cfg, cluster)
    layout = engine_metas_from_config(cfg, cluster, fp8=fp8)
    lengths = [e.tensors[0].region.length for e in layout]
    modes = ("serial", "pipelined")
    with contextlib.ExitStack() as stack:
        step = stack.enter_context(steps(console, "pipeline benchmark", 2 + repeats,
                                         quiet=json_to_stdout(json_path)))
        step("start engine processes")
        targets, engines = start_engine_targets(stack, layout)
        step("plan and reference digests")
        plan = compute_plan(trainer_meta, engines, cluster, model=cfg, fp8=fp8)
        plan.validate()
        want = expected_digests(cfg, state, engines, lengths, fp8)
        seconds = {m: [] for m in modes}
        reports = {m: [] for m in modes}
        verified = dict.fromkeys(modes, True)
        for i in range(repeats):
            step(f"round {i + 1} of {repeats}: serial, pipelined")
            for mode in modes:
                for t in targets:
                    t.fill(0)
                rs: list = []
                seconds[mode].append(asyncio.run(run_ranks(
                    plan, trainer_meta, state, targets, serial=mode == "serial",
                    gbps=nic_gbps, watermark=parse_size(watermark),
                    bucket_bytes=parse_size(bucket_bytes), reports=rs)))
                reports[mode].append(rs)
                verified[mode] &= [t.digest(0, n) for t, n in
                                   zip(targets, lengths, strict=True)] == want
    results = {m: _mode_result(m, seconds[m], reports[m], plan.bytes_total, verified[m])
               for m in modes}
    link_s = max(r.bytes_planned for r in reports["serial"][0]) / (nic_gbps * 1e9)
    prepare_s = results["serial"]["prepare_s"]
    binding = "link" if link_s >= prepare_s else "cpu"
    speedup = results["serial"]["seconds"] / results["pipelined"]["seconds"]
    _print(console, plan, trainer_meta, engines, results, link_s, binding, speedup)
    emit_json(json_path, {**results, "speedup": speedup, "bytes": plan.bytes_total,
                          "tasks": plan.num_tasks, "link_bound_s": link_s, "binding": binding,
                          "nic_gbps": nic_gbps, "repeats": repeats,
                          "bucket_bytes": parse_size(bucket_bytes)}, console)
    return 0 if all(r["verified"] for r in results.values()) else 1


def _print(console, plan, trainer_meta, engines, results, link_s, binding, speedup) -> None:
    table = Table(title=f"{plan.bytes_total / 1e6:.1f} MB, {plan.num_tasks} tasks, "
                        f"{len(trainer_meta.ranks)} trainer ranks -> {len(engines)} engine ranks")
    for col in ("mode", "seconds", "GB/s", "prepare busy s", "verified"):
        table.add_column(col, justify="right")
    for mode, r in results.items():
        table.add_row(mode, f"{r['seconds']:.3f}", f"{r['gbps']:.2f}", f"{r['prepare_s']:.3f}",
                      str(r["verified"]))
    console.print(table)
    console.print(f"link bound (busiest trainer NIC's bytes / cap): {link_s:.3f} s; "
                  f"busiest rank's prepare work (serial run): "
                  f"{results['serial']['prepare_s']:.3f} s -> the [bold]{binding}[/] binds")
    console.print(f"speedup of pipelining: [bold]{speedup:.2f}x[/]")
