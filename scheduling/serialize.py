"""msgpack round trips of a whole :class:`Plan` and of one trainer's :class:`TrainerPlan`.

Both encodings are compact: every string (parameter, tensor, NIC, owner
names, dtypes) is stored once in a string table and referred to by index;
pieces and regions are stored once and tasks refer to them by index; a plan's
task columns travel as raw little-endian numpy bytes::

    blob = dumps_trainer_plan(plan.trainer_plan(rank))   # what trainer ``rank`` receives
    assert loads_trainer_plan(blob) == plan.trainer_plan(rank)
    plan2 = loads_plan(dumps_plan(plan))                 # same tasks, same order

Decoding checks every field before use (:mod:`scheduling.decode`,
:mod:`scheduling.decode_plan`): a corrupt blob, an unknown format version, a
negative or overflowing size, an index outside its table, an unknown dtype or
transform, a task outside its region is a ValueError naming the field.
"""

from __future__ import annotations

from typing import Any

import msgpack

from scheduling.decode import FORMAT, Reader, check_tasks, unpack
from scheduling.decode_plan import COLUMNS, decode_plan
from scheduling.plan import Plan, TrainerGroup, TrainerPlan
from scheduling.tables import Interner
from weight_transfer.receipt import check_int
from weight_transfer.types import (
    EngineRankMeta,
    MeshDesc,
    ParamMeta,
    Piece,
    RegionDesc,
    WriteTask,
)

_COLUMNS = COLUMNS


class _Enc:
    """Shared encoders; ``s`` interns strings."""

    def __init__(self) -> None:
        self.s = Interner()

    def piece(self, p: Piece) -> list:
        flat = [x for ab in p.src_slice for x in ab]
        s = self.s
        return [s(p.dst_tensor), p.dst_offset, p.nbytes, s(p.dst_dtype), s(p.src_param), flat,
                s(str(p.transform))]

    def region(self, r: RegionDesc) -> list:
        s = self.s
        return [s(r.owner), s(r.nic), r.addr, r.length, r.rkey, s(r.transport), s(r.node)]

    def mesh(self, m: MeshDesc | None) -> list | None:
        if m is None:
            return None
        return [list(m.ranks), list(m.shape), [self.s(d) for d in m.dim_names]]


def _pack(kind: str, body: dict[str, Any], enc: _Enc) -> bytes:
    return msgpack.packb(
        {"format": FORMAT, "kind": kind, "strings": enc.s.values, **body}, use_bin_type=True
    )


# --------------------------------------------------------------------------- trainer plan


def dumps_trainer_plan(tp: TrainerPlan) -> bytes:
    """Encode what one trainer receives; pieces and regions deduplicated by index."""
    enc = _Enc()
    pieces: dict[Piece, int] = {}
    regions: dict[RegionDesc, int] = {}
    groups = []
    for g in tp.groups:
        tasks = []
        for t in g.tasks:
            p = pieces.setdefault(t.piece, len(pieces))
            r = regions.setdefault(t.region, len(regions))
            tasks += [t.task_id, p, enc.s(t.dst_replica), t.dst_rank, r, t.region_offset]
        groups.append([g.group, enc.mesh(g.mesh), [enc.s(n) for n in g.params], tasks,
                       [enc.s(n) for n in g.local]])
    body = {
        "rank": tp.rank,
        "pieces": [enc.piece(p) for p in pieces],
        "regions": [enc.region(r) for r in regions],
        "groups": groups,
    }
    return _pack("trainer_plan", body, enc)


def loads_trainer_plan(blob: bytes) -> TrainerPlan:
    """Decode what one trainer receives, checking every field (ValueError naming it)."""
    data = unpack(blob, "trainer_plan")
    rd = Reader(data, "trainer_plan")
    pieces = [rd.piece(v, f"pieces[{i}]") for i, v in enumerate(rd.list(data, "pieces"))]
    regions = [rd.region(v, f"regions[{i}]") for i, v in enumerate(rd.list(data, "regions"))]
    rank = check_int(rd.field(data, "rank"), "trainer_plan blob: rank", hi=1 << 24)
    groups, seen = [], set()
    for k, g in enumerate(rd.list(data, "groups")):
        where = f"groups[{k}]"
        fields = rd.list(g, where)
        if len(fields) not in (4, 5):  # 4: a plan of before shard-direct pieces (no local)
            raise ValueError(f"trainer_plan blob: {where} must be a list of 5, not "
                             f"{len(fields)} items")
        group, mesh, params, flat, local = (*fields, [])[:5]
        check_int(group, f"trainer_plan blob: {where}: group", hi=1 << 24)
        if group in seen:
            raise ValueError(f"trainer_plan blob: mesh group {group} is listed twice")
        seen.add(group)
        flat = rd.ints(flat, f"{where}: tasks")
        if len(flat) % 6:
            raise ValueError(f"trainer_plan blob: {where}: {len(flat)} task fields is not a "
                             "multiple of 6")
        tasks = tuple(
            WriteTask(task_id=flat[i], mesh_group=group, src_rank=rank,
                      piece=pieces[rd.index(flat[i + 1], pieces, f"{where} task {i // 6}: piece")],
                      dst_replica=rd.str(flat[i + 2], f"{where} task {i // 6}: replica"),
                      dst_rank=flat[i + 3],
                      region=regions[rd.index(flat[i + 4], regions,
                                              f"{where} task {i // 6}: region")],
                      region_offset=flat[i + 5])
            for i in range(0, len(flat), 6)
        )
        names = tuple(rd.str(p, f"{where}: params") for p in rd.list(params, f"{where}: params"))
        if len(set(names)) != len(names):
            raise ValueError(f"trainer_plan blob: {where}: a parameter is gathered twice")
        local = tuple(rd.str(p, f"{where}: local") for p in rd.list(local, f"{where}: local"))
        if len(set(local)) != len(local) or set(local) & set(names):
            raise ValueError(f"trainer_plan blob: {where}: a parameter is listed twice in "
                             "local, or is both gathered and local")
        groups.append(TrainerGroup(group=group, mesh=rd.mesh(mesh, f"{where}: mesh"),
                                   params=names, tasks=tasks, local=local))
    plan = TrainerPlan(rank=rank, groups=tuple(groups))
    check_tasks(plan.tasks, f"trainer_plan blob of rank {rank}")
    return plan


# --------------------------------------------------------------------------- whole plan


def _param(enc: _Enc, p: ParamMeta, meshes: dict[MeshDesc, int]) -> list:
    mesh = meshes.setdefault(p.mesh, len(meshes))
    placements = [[enc.s(x.kind), x.dim] for x in p.placements]
    return [enc.s(p.name), list(p.shape), enc.s(p.dtype), mesh, placements]


def _engine(enc: _Enc, e: EngineRankMeta, regions: dict[RegionDesc, int]) -> list:
    s, sh = enc.s, e.shard
    tensors = [[s(t.name), list(t.shape), s(t.dtype), regions[t.region], t.offset]
               for t in e.tensors]
    return [s(e.replica), e.rank, s(e.node), s(e.nic),
            [sh.tp_rank, sh.tp_size, sh.ep_rank, sh.ep_size], tensors]


def dumps_plan(plan: Plan) -> bytes:
    """Encode a whole plan (metadata, pieces, regions and task columns)."""
    enc = _Enc()
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
            getattr(plan, c).dtype.newbyteorder("<")).tobytes()] for c in _COLUMNS},
    }
    body["meshes"] = [enc.mesh(m) for m in meshes]
    return _pack("plan", body, enc)


def loads_plan(blob: bytes, *, validate: bool = True) -> Plan:
    """Decode a whole plan, checking every field (ValueError naming it); ``validate`` also
    runs :meth:`Plan.validate` (every destination byte written exactly once)."""
    data = unpack(blob, "plan")
    plan = decode_plan(data, Reader(data, "plan"))
    if validate:
        plan.validate()
    return plan
