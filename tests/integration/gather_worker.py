"""A rank of the N-D gather tests: DTensors on 2-D/3-D CPU gloo meshes, gathered in buckets.

Run by ``multiprocessing`` spawn from tests/integration/test_gather_nd.py. Every
rank builds the same seeded full tensors, distributes them over the case's mesh
and placements (``distribute_tensor``: ``torch.chunk`` per mesh dim, uneven
chunks included), cuts buckets from the live metadata, gathers each bucket with
:func:`weight_transfer.sender.gather.gather_bucket` (recording its collectives) and
with one ``full_tensor()`` per parameter, and sends back both results and the
record. A case: ``(mesh shape, mesh dim names, rank grid or None, placements as
("shard", dim) / ("replicate",), [(name, shape, dtype)], bucket_bytes)``.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from weight_transfer.model.live_metadata import param_metas_from_module
from weight_transfer.sender.gather import gather_bucket, plan_buckets

_PLACEMENT = {"shard": lambda dim: Shard(dim), "replicate": lambda: Replicate()}


def full_value(name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """The same seeded tensor on every rank (a name's own seed)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def plain(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as picklable plain data (tensors sent through a pipe live in shared
    memory that vanishes when this process exits)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return str(t.dtype), tuple(t.shape), raw.numpy().tobytes()


def run_case(case) -> dict:
    shape, names, grid, placements, params, bucket_bytes = case
    world = dist.get_world_size()
    ranks = torch.arange(world) if grid is None else torch.tensor(grid)
    mesh = DeviceMesh("cpu", ranks.reshape(shape), mesh_dim_names=names)
    pl = [_PLACEMENT[p[0]](*p[1:]) for p in placements]
    root = nn.Module()
    for name, pshape, dtype in params:
        dt = distribute_tensor(full_value(name, pshape, dtype), mesh, pl)
        root.register_parameter(name, nn.Parameter(dt, requires_grad=False))
    metas = param_metas_from_module(root)
    locals_ = dict(root.named_parameters())
    buckets = plan_buckets(metas, bucket_bytes=bucket_bytes)
    record: list[tuple] = []
    bucketed = {}
    for b in buckets:
        fulls = gather_bucket(b, [locals_[m.name] for m in b.params], record=record.append)
        bucketed.update({m.name: plain(f) for m, f in zip(b.params, fulls, strict=True)})
    reference = {n: plain(p.full_tensor()) for n, p in locals_.items()}
    return {"metas": metas, "buckets": [[m.name for m in b.params] for b in buckets],
            "coalesced": [b.coalesced for b in buckets], "record": record,
            "bucketed": bucketed, "reference": reference,
            "coordinate": tuple(mesh.get_coordinate())}


def run_rank(rank: int, world: int, port: int, cases, conn) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        conn.send([run_case(c) for c in cases])
    except BaseException as exc:
        conn.send(exc)
        raise
    finally:
        dist.destroy_process_group()
