"""A trainer rank for the multi-process tests: FSDP2 over a CPU gloo mesh, then RankTransfer.

Run by ``torch.multiprocessing``/``multiprocessing`` spawn from a test. The rank
builds the model from a seeded random state dict (every rank the same values),
keeps the dense parameters and the experts of its own expert-parallel mesh,
shards experts with ``fully_shard`` over its EP mesh and the rest over all
ranks, reports its live parameter metadata, then replays the plans it is sent.
A job is ``(version, plan blob, peer infos, SimNic options[, RankTransfer options])``;
the answer is the rank's report, and with ``record_collectives`` in the options
the pair (report, the collectives it issued in order).
"""

from __future__ import annotations

import asyncio
import datetime
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.model.live_metadata import param_metas_from_module
from weight_transfer.model.models import load_model_config
from weight_transfer.plan.wire import loads_trainer_plan
from weight_transfer.sender.executor import RankTransfer
from weight_transfer.sync.barrier import BarrierKey, StoreBarrier
from weight_transfer.transport.simnic.nic import SimNic

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.(\d+))\.")


def module_from_state(state: dict[str, torch.Tensor]) -> nn.Module:
    """An nn.Module tree whose parameter names are exactly the state dict's keys."""
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


def build_sharded_model(cfg, state, rank: int, world: int, ep: int, layout: str) -> nn.Module:
    """Experts on ``ep`` disjoint meshes laid out as the cluster config says:
    ``strided`` (mesh k = ranks r with r % ep == k) or ``contiguous`` blocks."""
    per_mesh = world // ep
    strided = layout == "strided"
    mine = rank % ep if strided else rank // per_mesh
    n_experts = cfg.n_experts or 0
    keep = {}
    expert_modules = set()
    for name, value in state.items():
        m = _EXPERT.match(name)
        if m is not None:
            if int(m.group(2)) * ep // n_experts != mine:
                continue
            expert_modules.add(m.group(1))
        keep[name] = value
    model = module_from_state(keep)
    if expert_modules:
        shape, names = ((per_mesh, ep), ("fsdp", "ep")) if strided else ((ep, per_mesh),
                                                                         ("ep", "fsdp"))
        ep_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)["fsdp"]
        for path in sorted(expert_modules):
            fully_shard(model.get_submodule(path), mesh=ep_mesh)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
    return model


def run_rank(rank: int, world: int, port: int, cfg_path: str, seed: int, ep: int, layout: str,
             conn, key: BarrierKey) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        cfg = load_model_config(cfg_path)
        model = build_sharded_model(cfg, random_state_dict(cfg, seed=seed), rank, world, ep,
                                    layout)
        metas = param_metas_from_module(model)
        conn.send(metas)
        params = dict(model.state_dict(keep_vars=True))
        barrier = StoreBarrier(store, rank=rank, ranks=range(world), key=key, timeout_s=120)
        while (job := conn.recv()) is not None:
            version, blob, peers, opts, *more = job
            xfer = more[0] if more else {}
            with SimNic(owner=f"trainer{rank}", nic=f"trainer-nic{rank}", **opts) as nic:
                for peer in peers:
                    nic.connect(peer)
                transfer = RankTransfer(plan=loads_trainer_plan(blob), params=metas,
                                        get_param=params.__getitem__, transport=nic,
                                        barrier=barrier, **xfer)
                try:
                    report = asyncio.run(transfer.run(version=version))
                finally:
                    transfer.close()
            conn.send((report, transfer.collectives) if xfer.get("record_collectives")
                      else report)
    except BaseException as exc:
        conn.send(exc)
        raise
    finally:
        dist.destroy_process_group()
