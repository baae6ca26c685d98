"""Benchmark the gather: one collective per parameter beside coalesced buckets, side by side.

Spawns the cluster's trainer ranks as processes in one gloo group; each builds
the model from the same seeded state dict, shards it as ``--layout`` says, and
replays the same plan into engine regions of separate processes over uncapped
simnic, alternating ``gather="param"`` and ``gather="bucket"`` for
``--updates`` rounds. The layouts (:data:`LAYOUTS`):

* ``fsdp``: every parameter ``fully_shard`` over all ranks (per decoder layer,
  then the root; experts too), FSDP2's 1-D ``(Shard(0),)``: one mesh group;
* ``hsdp``: the same over the 2-D mesh ``(dp_replicate, dp_shard)``
  (``trainer.replicate`` of the cluster, 2 if it is 1), placements
  ``(Replicate(), Shard(0))``: a bucket is one all-gather inside a replica group;
* ``ep_fsdp``: MoE models only: experts stacked in 3-D parameters as 2-D DTensors on
  the cluster's ``(ep, dp_shard_in_ep)`` mesh, ``(Shard(0), Shard(1))`` (as the
  trainer actors hold them), dense parameters 1-D FSDP: a bucket of experts is
  two all-gathers (inside the EP group's FSDP ranks, then across EP groups).

Reported per layout and mode (median over rounds, slowest rank): the prepare
stage's busy time (gather + cuts, from the executor's spans) and the whole
update, with the load average before and after (the numbers are wall-clock on
a shared machine); every round checks that all planned bytes landed::

    wt bench gather --model configs/models/tiny_moe.yaml --layout hsdp --layout ep_fsdp

The options are defined once, in :mod:`actors.tools.cli.main`; this module has ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import statistics
from pathlib import Path

import torch.distributed as dist
from rich.table import Table

from actors.tools.bench.pipeline import NO_CHECKSUMS
from actors.tools.cli.progress import command_console, emit_json
from actors.tools.testkit.harness import RemoteTarget
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.live_metadata import param_metas_from_module
from weight_transfer.model.models import load_model_config
from weight_transfer.plan.wire import dumps_trainer_plan, loads_trainer_plan
from weight_transfer.sender.executor import RankTransfer
from weight_transfer.sync.barrier import BarrierKey, StoreBarrier
from weight_transfer.sync.listen import serve_store
from weight_transfer.types import MeshDesc, TrainerMeta

MODES = ("param", "bucket")
LAYOUTS = ("fsdp", "hsdp", "ep_fsdp")
_STACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _module(state):
    from torch import nn

    root = nn.Module()
    for name, value in state.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(value.clone(), requires_grad=False))
    return root


def _device_mesh(desc: MeshDesc):
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.tensor(desc.ranks, dtype=torch.int64).reshape(desc.shape)
    return DeviceMesh("cpu", grid, mesh_dim_names=desc.dim_names)


def _dense_mesh(layout: str, cluster) -> MeshDesc:
    world = cluster.trainer_world
    if layout != "hsdp":
        return MeshDesc(ranks=tuple(range(world)), shape=(world,), dim_names=("dp_shard",))
    rep = cluster.trainer.replicate if cluster.trainer.replicate > 1 else 2
    return MeshDesc(ranks=tuple(range(world)), shape=(rep, world // rep),
                    dim_names=("dp_replicate", "dp_shard"))


def _sharded(state, layout: str, cluster):
    """The module of ``state`` sharded as ``layout`` says (the module docstring)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    root = _module(state)
    experts: set[nn.Parameter] = set()
    if layout == "ep_fsdp":
        desc, placements = cluster.stacked_expert_mesh()
        mesh, pl = _device_mesh(desc), [Shard(p.dim) for p in placements]
        for name, value in state.items():
            if name.endswith(_STACKED):
                owner, leaf = root.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
                param = nn.Parameter(distribute_tensor(value, mesh, pl), requires_grad=False)
                owner.register_parameter(leaf, param)
                experts.add(param)
    mesh = _device_mesh(_dense_mesh(layout, cluster))
    layers = getattr(getattr(root, "model", root), "layers", None)
    for layer in layers.children() if layers is not None else ():
        fully_shard(layer, mesh=mesh, ignored_params=experts or None)
    fully_shard(root, mesh=mesh, ignored_params=experts or None)
    return root


def _naming(layout: str) -> str:
    return "stacked" if layout == "ep_fsdp" else "per_expert"


def _rank(rank: int, world: int, port: int, cfg_path: str, layout: str, cluster_path: str,
          conn, key: BarrierKey) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from weight_transfer.transport.simnic.nic import SimNic

    try:
        cfg = load_model_config(cfg_path)
        state = random_state_dict(cfg, seed=0, expert_naming=_naming(layout))
        model = _sharded(state, layout, load_cluster_config(cluster_path))
        metas = param_metas_from_module(model)
        conn.send(metas)
        params = dict(model.state_dict(keep_vars=True))
        barrier = StoreBarrier(store, rank=rank, ranks=range(world), key=key, timeout_s=300)
        blob, peers = conn.recv()
        with SimNic(owner=f"trainer{rank}", nic=f"trainer-nic{rank}") as nic:
            for peer in peers:
                nic.connect(peer)
            transfers = {m: RankTransfer(plan=loads_trainer_plan(blob), params=metas,
                                         get_param=params.__getitem__, transport=nic,
                                         barrier=barrier, gather_unit=m, integrity=NO_CHECKSUMS)
                         for m in MODES}
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


def measure(model: Path, cluster_path: Path, updates: int, layout: str = "fsdp") -> dict:
    """Per mode: median prepare and update seconds of the slowest rank, and bytes checks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    cfg = load_model_config(model)
    cluster = load_cluster_config(cluster_path)
    world = cluster.trainer_world
    layout_engines = engine_metas_from_config(cfg, cluster, fp8=False)
    ctx = mp.get_context("spawn")
    store = serve_store("127.0.0.1", timeout_s=300)  # loopback only, not [::]
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        targets = [stack.enter_context(RemoteTarget(
            nbytes=e.tensors[0].region.length, guard_bytes=0, owner=str(e.id),
            transport_opts={"nic": e.tensors[0].region.nic})) for e in layout_engines]
        pipes, procs, key = [], [], BarrierKey.new()
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank, args=(r, world, store.port, str(model), layout,
                                                str(cluster_path), child, key), daemon=True)
            p.start()
            pipes.append(parent)
            procs.append(p)
        stack.callback(_stop, pipes, procs)
        merged = {m.name: m for metas in (_recv(p) for p in pipes) for m in metas}
        meta = TrainerMeta(params=tuple(merged.values()), ranks=cluster.rank_infos())
        engines = [dataclasses.replace(e, tensors=tuple(
            dataclasses.replace(t, region=tg.region) for t in e.tensors))
            for e, tg in zip(layout_engines, targets, strict=True)]
        # gather="full": this bench measures the gathers themselves (shard-direct pieces
        # would skip most of them; wt bench designs compares the two plans)
        plan = compute_plan(meta, engines, cluster, model=cfg, fp8=False,
                            expert_naming=_naming(layout), gather="full")
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
    meshes = sorted({(m.mesh.shape, tuple(map(str, m.placements))) for m in meta.params})
    out = {"model": cfg.name, "layout": layout, "bytes": plan.bytes_total,
           "params": len(meta.params), "meshes": [f"{s} {p}" for s, p in meshes],
           "load_before": load_before, "load_after": os.getloadavg()[0]}
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


def run(models: list[Path], cluster: Path, updates: int, json_path: Path | None,
        layouts: list[str] | tuple[str, ...] = ("fsdp",)) -> int:
    console = command_console(json_path)
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        raise ValueError(f"--layout must be one of {LAYOUTS}, not {bad}")
    results = []
    for model in models:
        experts = bool(load_model_config(model).n_experts)
        for layout in layouts:
            if layout == "ep_fsdp" and not experts:
                console.print(f"{model}: no experts, layout ep_fsdp skipped")
                continue
            console.print(f"[bold]gather benchmark[/]: {model}, {layout} "
                          f"({updates} updates per mode)")
            results.append(measure(model, cluster, updates, layout))
    table = Table(title="prepare stage (gather + cuts) and update, slowest rank, median")
    for col in ("model", "layout", "MB", "gather", "items/rank", "prepare s", "update s",
                "landed", "load"):
        table.add_column(col, justify="right")
    for r in results:
        for mode in MODES:
            m = r[mode]
            table.add_row(r["model"], r["layout"], f"{r['bytes'] / 1e6:.2f}", mode,
                          str(m["items_per_rank"]), f"{m['prepare_s']:.3f}",
                          f"{m['update_s']:.3f}", str(m["verified"]),
                          f"{r['load_before']:.1f}-{r['load_after']:.1f}")
    console.print(table)
    for r in results:
        console.print(f"{r['model']} {r['layout']} ({'; '.join(r['meshes'])}): prepare "
                      f"[bold]{r['prepare_speedup']:.2f}x[/], update "
                      f"[bold]{r['update_speedup']:.2f}x[/] faster with buckets")
    emit_json(json_path, {"results": results}, console)
    return 0 if all(r[m]["verified"] for r in results for m in MODES) else 1
