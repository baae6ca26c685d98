"""Benchmark the gather: one collective per parameter beside coalesced buckets, side by side.

Spawns the cluster's trainer ranks as processes in one gloo group; each builds
the model from the same seeded state dict, shards every parameter with FSDP2
over all ranks (``fully_shard`` per decoder layer, then the root; experts too,
so there is one mesh group), and replays the same plan into engine regions of
separate processes over uncapped simnic, alternating ``gather="param"`` and
``gather="bucket"`` for ``--updates`` rounds. Reported per mode (median over
rounds, slowest rank): the prepare stage's busy time (gather + cuts, from the
executor's spans) and the whole update; every round checks that all planned
bytes landed::

    wt bench gather --model configs/models/tiny_llama.yaml --json gather.json

The options are defined once, in :mod:`scripts.cli`; this module has ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import statistics
from pathlib import Path

import torch.distributed as dist
from rich.table import Table

from reference.random_state import random_state_dict
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config
from scheduling.serialize import dumps_trainer_plan, loads_trainer_plan
from scripts.progress import command_console, emit_json
from testkit.harness import RemoteTarget
from weight_transfer.barrier import StoreBarrier
from weight_transfer.executor import RankTransfer
from weight_transfer.live_metadata import param_metas_from_module
from weight_transfer.models import load_model_config
from weight_transfer.types import TrainerMeta

MODES = ("param", "bucket")


def _sharded(state, world: int):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = nn.Module()
    for name, value in state.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(value.clone(), requires_grad=False))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    layers = getattr(getattr(root, "model", root), "layers", None)
    for layer in layers.children() if layers is not None else ():
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    return root


def _rank(rank: int, world: int, port: int, cfg_path: str, conn) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from weight_transfer.transport.simnic import SimNic

    try:
        model = _sharded(random_state_dict(load_model_config(cfg_path), seed=0), world)
        metas = param_metas_from_module(model)
        conn.send(metas)
        params = dict(model.state_dict(keep_vars=True))
        barrier = StoreBarrier(store, rank=rank, ranks=range(world), timeout_s=300)
        blob, peers = conn.recv()
        with SimNic(owner=f"trainer{rank}", nic=f"trainer-nic{rank}") as nic:
            for peer in peers:
                nic.connect(peer)
            transfers = {m: RankTransfer(plan=loads_trainer_plan(blob), params=metas,
                                         get_param=params.__getitem__, transport=nic,
                                         barrier=barrier, gather=m) for m in MODES}
            while (job := conn.recv()) is not None:
                version, mode = job
                rep = asyncio.run(transfers[mode].run(version=version))
                prep = sum(s.end - s.start for s in rep.spans if s.stage == "prepare")
                conn.send({"prepare_s": prep, "update_s": rep.seconds,
                           "bytes": rep.bytes_written, "planned": rep.bytes_planned,
                           "buckets": len(rep.spans) // 3})
            for t in transfers.values():
                t.close()
    except BaseException as exc:
        conn.send(exc)
        raise
    finally:
        dist.destroy_process_group()


def _recv(pipe):
    if not pipe.poll(600):
        raise TimeoutError("a trainer rank did not answer in 600 s")
    out = pipe.recv()
    if isinstance(out, BaseException):
        raise RuntimeError(f"a trainer rank failed: {out!r}") from out
    return out


def measure(model: Path, cluster_path: Path, updates: int) -> dict:
    """Per mode: median prepare and update seconds of the slowest rank, and bytes checks."""
    cfg = load_model_config(model)
    cluster = load_cluster_config(cluster_path)
    world = cluster.trainer_world
    layout = engine_metas_from_config(cfg, cluster, fp8=False)
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True,
                          timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    with contextlib.ExitStack() as stack:
        targets = [stack.enter_context(RemoteTarget(
            nbytes=e.tensors[0].region.length, guard_bytes=0, owner=f"{e.replica}/tp{e.rank}",
            transport_opts={"nic": e.tensors[0].region.nic})) for e in layout]
        pipes, procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank, args=(r, world, store.port, str(model), child),
                            daemon=True)
            p.start()
            pipes.append(parent)
            procs.append(p)
        stack.callback(_stop, pipes, procs)
        merged = {m.name: m for metas in (_recv(p) for p in pipes) for m in metas}
        meta = TrainerMeta(params=tuple(merged.values()), ranks=cluster.rank_infos())
        engines = [dataclasses.replace(e, tensors=tuple(
            dataclasses.replace(t, region=tg.region) for t in e.tensors))
            for e, tg in zip(layout, targets, strict=True)]
        plan = compute_plan(meta, engines, cluster, model=cfg, fp8=False)
        for r, pipe in enumerate(pipes):
            pipe.send((dumps_trainer_plan(plan.trainer_plan(r)), [t.peer_info for t in targets]))
        version = 0
        for _ in range(updates):
            for mode in MODES:
                version += 1
                for pipe in pipes:
                    pipe.send((version, mode))
                reps = [_recv(p) for p in pipes]
                rounds[mode].append({
                    "prepare_s": max(x["prepare_s"] for x in reps),
                    "update_s": max(x["update_s"] for x in reps),
                    "landed": sum(x["bytes"] for x in reps) == plan.bytes_total,
                    "buckets": max(x["buckets"] for x in reps)})
    out = {"model": cfg.name, "bytes": plan.bytes_total, "params": len(meta.params)}
    for mode, rs in rounds.items():
        out[mode] = {"prepare_s": statistics.median(x["prepare_s"] for x in rs),
                     "update_s": statistics.median(x["update_s"] for x in rs),
                     "items_per_rank": rs[0]["buckets"],
                     "verified": all(x["landed"] for x in rs)}
    out["prepare_speedup"] = out["param"]["prepare_s"] / out["bucket"]["prepare_s"]
    out["update_speedup"] = out["param"]["update_s"] / out["bucket"]["update_s"]
    return out


def _stop(pipes, procs) -> None:
    for p in pipes:
        with contextlib.suppress(Exception):
            p.send(None)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()


def run(models: list[Path], cluster: Path, updates: int, json_path: Path | None) -> int:
    console = command_console(json_path)
    results = []
    for model in models:
        console.print(f"[bold]gather benchmark[/]: {model} ({updates} updates per mode)")
        results.append(measure(model, cluster, updates))
    table = Table(title="prepare stage (gather + cuts) and update, slowest rank, median")
    for col in ("model", "MB", "gather", "items/rank", "prepare s", "update s", "landed"):
        table.add_column(col, justify="right")
    for r in results:
        for mode in MODES:
            m = r[mode]
            table.add_row(r["model"], f"{r['bytes'] / 1e6:.2f}", mode, str(m["items_per_rank"]),
                          f"{m['prepare_s']:.3f}", f"{m['update_s']:.3f}", str(m["verified"]))
    console.print(table)
    for r in results:
        console.print(f"{r['model']}: prepare [bold]{r['prepare_speedup']:.2f}x[/], update "
                      f"[bold]{r['update_speedup']:.2f}x[/] faster with buckets")
    emit_json(json_path, {"results": results}, console)
    return 0 if all(r[m]["verified"] for r in results for m in MODES) else 1
