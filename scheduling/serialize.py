"""msgpack round trip of a whole :class:`~scheduling.plan.Plan`.

Strings, pieces and regions are stored once and referred to by index (the
:class:`~weight_transfer.plan.wire.Encoder` that one trainer's plan uses too); the task
columns travel as raw little-endian numpy bytes::

    plan2 = loads_plan(dumps_plan(plan))                 # same tasks, same order

Decoding checks every field before use (:mod:`weight_transfer.plan.decode`,
:mod:`scheduling.decode_plan`): a corrupt blob, an unknown format version, a
negative or overflowing size, an index outside its table, an unknown dtype or
transform, a task outside its region is a ValueError naming the field.
"""

from __future__ import annotations

from scheduling.decode_plan import COLUMNS, decode_plan
from scheduling.plan import Plan
from weight_transfer.plan.decode import Reader, unpack
from weight_transfer.plan.wire import Encoder, pack
from weight_transfer.types import (
    EngineRankMeta,
    MeshDesc,
    ParamMeta,
    RegionDesc,
)

# --------------------------------------------------------------------------- trainer plan


# --------------------------------------------------------------------------- whole plan


def _param(enc: Encoder, p: ParamMeta, meshes: dict[MeshDesc, int]) -> list:
    mesh = meshes.setdefault(p.mesh, len(meshes))
    placements = [[enc.s(x.kind), x.dim] for x in p.placements]
    return [enc.s(p.name), list(p.shape), enc.s(p.dtype), mesh, placements]


def _engine(enc: Encoder, e: EngineRankMeta, regions: dict[RegionDesc, int]) -> list:
    s, sh = enc.s, e.shard
    tensors = [[s(t.name), list(t.shape), s(t.dtype), regions[t.region], t.offset]
               for t in e.tensors]
    return [s(e.replica), e.rank, s(e.node), s(e.nic),
            [sh.tp_rank, sh.tp_size, sh.ep_rank, sh.ep_size], tensors]


def dumps_plan(plan: Plan) -> bytes:
    """Encode a whole plan (metadata, pieces, regions and task columns)."""
    enc = Encoder()
    meshes: dict[MeshDesc, int] = {}
    regions = {r: i for i, r in enumerate(plan.regions)}
    body = {
        "params": [_param(enc, p, meshes) for p in plan.params],
        "ranks": [[r.rank, enc.s(r.node), enc.s(r.nic)] for r in plan.trainer_ranks],
        "regions": [enc.region(r) for r in plan.regions],
        "engines": [_engine(enc, e, regions) for e in plan.engines],
        "pieces": [enc.piece(p) for p in plan.pieces],
        "send_nics": [enc.s(n) for n in plan.send_nics],
        "recv_nics": [enc.s(n) for n in plan.recv_nics],
        "sched_meshes": [meshes.setdefault(m, len(meshes)) for m in plan.meshes],
        "mesh_group": list(plan.mesh_group),
        "param_mesh": list(plan.param_mesh),
        "group_params": [list(g) for g in plan.group_params],
        "gather": enc.s(plan.gather),
        "direct_params": list(plan.direct_params),
        "fallback": [[i, enc.s(r)] for i, r in plan.fallback],
        "columns": {c: [str(getattr(plan, c).dtype), getattr(plan, c).astype(
            getattr(plan, c).dtype.newbyteorder("<")).tobytes()] for c in COLUMNS},
    }
    body["meshes"] = [enc.mesh(m) for m in meshes]
    return pack("plan", body, enc)


def loads_plan(blob: bytes, *, validate: bool = True) -> Plan:
    """Decode a whole plan, checking every field (ValueError naming it); ``validate`` also
    runs :meth:`Plan.validate` (every destination byte written exactly once)."""
    data = unpack(blob, "plan")
    plan = decode_plan(data, Reader(data, "plan"))
    if validate:
        plan.validate()
    return plan
