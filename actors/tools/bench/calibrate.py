"""``wt simulate --calibrate [--check] [--write C.yaml]``: this machine's simulator constants.

:func:`measure` times, in a bounded time (about 10-30 s):

* ``copy_gbps``: one 64 MiB ``torch`` copy (the cuts into staging, and what a
  simnic WRITE costs);
* ``fp8_quant_gbps``: ``weight_transfer.layout.quant.quantize_fp8_blocks`` of a bf16
  matrix by one thread (one rank alone: the ranks' sharing of the cores is
  the simulator's ``cpu_cores`` model, not folded into the rate);
* ``cpu_cores``: the cores this process may run on, which the bench's ranks share;
* ``intra_node_gbps`` / ``gather_latency_us``: a gloo all-gather between 2
  processes on loopback (a large and a tiny one, solved for bandwidth and latency
  with the ring formula of :mod:`scheduling.sim.gather`);
* ``write_overhead_us``: one simnic issuing a few hundred 64-byte writes
  together into an engine process, per write;
* ``param_overhead_us``: the fixed cost of a pipeline item (its gather call,
  even on one rank, and the Python around it): ``wt bench pipeline``'s ranks run
  ``PARAM_MODEL`` (not a check configuration) uncapped, minus what the stage
  model predicts without this term, per parameter on the critical ranks.

:func:`check` then runs ``wt bench pipeline`` configurations (through
:mod:`actors.tools.bench.pipeline`'s helpers) and sets the simulator's prediction of
each beside the measured seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from weight_transfer.sender.buckets import DEFAULT_BUCKET_BYTES

PARAM_MODEL = "tiny_mixtral"  # many small parameters; not among CHECK_CONFIGS
UNCAPPED_GBPS = 1000.0  # the capped (worker-thread) write path, as the bench, but no waiting

CHECK_CONFIGS = (
    # model, fp8, NIC cap GB/s, mode, cluster (None: --cluster), bucket bytes (None: default)
    ("tiny_llama", False, 0.02, "pipelined", None, None),
    ("tiny_moe", True, 0.05, "pipelined", None, None),
    ("tiny_moe", True, 0.05, "serial", None, None),
    ("bench_moe", True, 0.1, "pipelined", None, None),
    ("bench_moe", False, 0.2, "serial", None, None),
    # 2 ranks and 16 MiB buckets, as `wt bench pipeline` (whose default model is bench_dense)
    ("bench_moe", True, 0.2, "pipelined", "bench_pipeline", 16 << 20),
    ("bench_moe", True, 0.2, "serial", "bench_pipeline", 16 << 20),
    ("bench_dense", True, 0.1, "pipelined", "bench_pipeline", 16 << 20),
    ("bench_dense", True, 0.1, "serial", "bench_pipeline", 16 << 20),
)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_gbps(nbytes: int = 64 << 20) -> float:
    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes,
                                                                            dtype=torch.uint8)
    return nbytes / _best(lambda: dst.copy_(src), 5) / 1e9


def fp8_quant_gbps(ranks: int = 4, rows: int = 2048, cols: int = 2048) -> float:
    """Source GB/s per rank with ``ranks`` threads quantizing at once."""
    from weight_transfer.layout.quant import quantize_fp8_blocks

    ws = [torch.randn(rows, cols, dtype=torch.bfloat16) for _ in range(ranks)]

    def all_at_once() -> None:
        ts = [threading.Thread(target=quantize_fp8_blocks, args=(w,)) for w in ws]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return ws[0].nbytes / _best(all_at_once, 3) / 1e9


def _gather_worker(rank: int, world: int, port: int, sizes: list[int], out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    res = []
    for n in sizes:
        x = torch.ones(n // world, dtype=torch.uint8)
        outs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)  # warm-up
        dist.barrier()
        res.append(_best(lambda o=outs, t=x: dist.all_gather(o, t), 5))
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def gloo_allgather(world: int = 2, big: int = 32 << 20, small: int = 1024) -> tuple[float, float]:
    """(GB/s per rank, latency per ring hop in us) of gloo all-gather on loopback."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gather_worker, args=(r, world, port, [small, big], q))
             for r in range(world)]
    for p in procs:
        p.start()
    t_small, t_big = q.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    hops = world - 1
    latency = t_small / hops
    bw = hops / world * big / max(t_big - hops * latency, 1e-9)
    return bw / 1e9, latency * 1e6


async def _timed_writes(nics, region, writes: int) -> float:
    src = torch.ones(64, dtype=torch.uint8)

    start = time.perf_counter()
    await asyncio.gather(*(n.write(src, region, (i % 64) * 64) for n in nics
                           for i in range(writes)))
    return time.perf_counter() - start


def write_overhead_us(ranks: int = 4, writes: int = 400) -> float:
    """Seconds per write (in us) of ``ranks`` simnics each issuing ``writes`` 64-byte
    writes at once into one engine process, as the executor issues a parameter's writes:
    the sender CPU a write costs, with the bench's ranks sharing the process."""
    from actors.tools.testkit.harness import RemoteTarget
    from weight_transfer.transport.simnic.nic import SimNic

    with RemoteTarget(nbytes=64 * 64, guard_bytes=0, owner="calibrate") as target:
        nics = [SimNic(owner=f"calibrate{r}", nic=f"nic{r}", bandwidth_gbps=UNCAPPED_GBPS)
                for r in range(ranks)]
        try:
            for n in nics:
                n.connect(target.peer_info)
            asyncio.run(_timed_writes(nics, target.region, 20))  # warm-up
            best = min(asyncio.run(_timed_writes(nics, target.region, writes))
                       for _ in range(3))
        finally:
            for n in nics:
                n.close()
    return best / writes * 1e6


def param_overhead_us(root: Path, cluster_path: Path, constants: dict[str, float]) -> float:
    """Per parameter and rank (us): ``PARAM_MODEL`` run uncapped by the bench's ranks,
    minus the stage model's prediction without this term, over the parameters on the
    critical ranks (the largest count per group, summed over the groups)."""
    from actors.tools.bench.pipeline import run_ranks
    from scheduling import simulate
    from scheduling.sim.stages import group_costs

    consts = {**constants, "param_overhead_us": 0.0}
    with _bench_setup(root, cluster_path, PARAM_MODEL, False) as (plan, tm, state, targets):
        sim_cluster = bench_cluster(plan_cluster(cluster_path), consts, cap=UNCAPPED_GBPS,
                                    serial=False, watermark=512 << 20)
        predicted = simulate(plan, sim_cluster, resolution=1e-3).seconds
        items = sum(int(c.params.sum(axis=1).max(initial=0))
                    for c in group_costs(plan, sim_cluster))
        measured = min(asyncio.run(run_ranks(plan, tm, state, targets, serial=False,
                                             gbps=UNCAPPED_GBPS, watermark=512 << 20))
                       for _ in range(3))
    return max(measured - predicted, 0.0) / max(items, 1) * 1e6


def measure(root: Path, cluster_path: Path) -> dict[str, float]:
    """The constants of one rank alone, and the cores they share (processor sharing in
    the simulator: ``cpu_cores``, :func:`scheduling.sim.simulate.cpu_floor`)."""
    bw, lat = gloo_allgather()
    out = {"copy_gbps": round(copy_gbps(), 3), "fp8_quant_gbps": round(fp8_quant_gbps(1), 3),
           "intra_node_gbps": round(bw, 3), "gather_latency_us": round(lat, 1),
           "write_overhead_us": round(write_overhead_us(1), 1),
           "cpu_cores": float(len(os.sched_getaffinity(0)))}
    out["param_overhead_us"] = round(param_overhead_us(root, cluster_path, out), 1)
    return out


def write_sim(path: Path, constants: dict[str, float]) -> None:
    """Replace the measured keys in the ``sim:`` section of a cluster YAML, keeping the rest."""
    lines = Path(path).read_text().splitlines()
    keep = [ln for ln in lines if not any(ln.strip().startswith(f"{k}:") for k in constants)]
    if "sim:" not in [ln.rstrip() for ln in keep]:
        keep.append("sim:")
    at = [ln.rstrip() for ln in keep].index("sim:") + 1
    new = [f"  {k}: {v}  # measured by wt simulate --calibrate" for k, v in constants.items()]
    Path(path).write_text("\n".join(keep[:at] + new + keep[at:]) + "\n")


def bench_cluster(cluster, constants: dict[str, float], *, cap: float, serial: bool,
                  watermark: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """The cluster as ``wt bench pipeline`` runs it: full tensors (no gathers, no h2d),
    trainer NICs capped at ``cap`` GB/s, engine side at memcpy speed."""
    sim = cluster.sim.model_copy(update={
        "gathers": False, "h2d_gbps": None, "fp8_quant_gbps": constants["fp8_quant_gbps"],
        "copy_gbps": constants["copy_gbps"], "watermark_bytes": 1 if serial else watermark,
        "max_inflight": 1 if serial else 4,
        "write_overhead_us": constants.get("write_overhead_us", 0.0),
        "param_overhead_us": constants.get("param_overhead_us", 0.0),
        # one host: every rank's prepare, write overheads and simnic copies share its cores
        "cpu_cores": constants.get("cpu_cores"), "write_copy_gbps": constants["copy_gbps"],
        "gather_mode": "bucket", "bucket_bytes": bucket_bytes})
    return cluster.model_copy(update={
        "sim": sim,
        "trainer": cluster.trainer.model_copy(update={"nic_gbps": cap * 8}),
        "inference": cluster.inference.model_copy(
            update={"nic_gbps": constants["copy_gbps"] * 8})})


def plan_cluster(cluster_path: Path):
    from scheduling import load_cluster_config

    return load_cluster_config(cluster_path)


@contextlib.contextmanager
def _bench_setup(root: Path, cluster_path: Path, model: str, fp8: bool):
    """(plan, trainer metadata, state dict, engine targets) as ``wt bench pipeline`` has them."""
    from actors.tools.testkit.harness import start_engine_targets
    from scheduling import compute_plan
    from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
    from weight_transfer.engines.reference.random_state import random_state_dict
    from weight_transfer.model.models import load_model_config

    cfg = load_model_config(root / "configs" / "models" / f"{model}.yaml")
    cluster = plan_cluster(cluster_path)
    state = random_state_dict(cfg, seed=0)
    tm = trainer_meta_from_config(cfg, cluster)
    layout = engine_metas_from_config(cfg, cluster, fp8=fp8)
    with contextlib.ExitStack() as stack:
        targets, engines = start_engine_targets(stack, layout)
        yield compute_plan(tm, engines, cluster, model=cfg, fp8=fp8), tm, state, targets


def check_one(root: Path, cluster_path: Path, constants: dict[str, float], model: str,
              fp8: bool, cap: float, mode: str, cluster: str | None = None,
              bucket_bytes: int | None = None, watermark: int = 512 << 20,
              repeats: int = 2) -> dict[str, Any]:
    """Predict and run one ``wt bench pipeline`` configuration (the best of ``repeats``
    runs, as the constants are best-of: a loaded machine only adds time)."""
    from actors.tools.bench.pipeline import run_ranks
    from scheduling import simulate

    if cluster is not None:
        cluster_path = root / "configs" / "clusters" / f"{cluster}.yaml"
    bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
    with _bench_setup(root, cluster_path, model, fp8) as (plan, tm, state, targets):
        serial = mode == "serial"
        sim_cluster = bench_cluster(plan_cluster(cluster_path), constants, cap=cap,
                                    serial=serial, watermark=watermark,
                                    bucket_bytes=bucket_bytes)
        predicted = simulate(plan, sim_cluster, resolution=1e-3)
        measured = min(asyncio.run(run_ranks(plan, tm, state, targets, serial=serial, gbps=cap,
                                             watermark=watermark, bucket_bytes=bucket_bytes))
                       for _ in range(repeats))
    ranks = len(plan.trainer_ranks)
    return {"config": f"{model} {'fp8' if fp8 else 'bf16'} {cap:g}GB/s {ranks} ranks {mode}",
            "predicted_s": predicted.seconds, "measured_s": measured,
            "lower_bound_s": predicted.lower_bound_seconds, "binding": predicted.binding,
            "error": predicted.seconds / measured - 1, "bytes": plan.bytes_total}


def check(root: Path, cluster_path: Path, constants: dict[str, float],
          configs=CHECK_CONFIGS) -> list[dict[str, Any]]:
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return [check_one(root, cluster_path, constants, *c) for c in configs]
