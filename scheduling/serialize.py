"""msgpack round trips of a whole :class:`Plan` and of one trainer's :class:`TrainerPlan`.

Both encodings are compact: every string (parameter, tensor, NIC, owner
names, dtypes) is stored once in a string table and referred to by index;
pieces and regions are stored once and tasks refer to them by index; a plan's
task columns travel as raw little-endian numpy bytes::

    blob = dumps_trainer_plan(plan.trainer_plan(rank))   # what trainer ``rank`` receives
    assert loads_trainer_plan(blob) == plan.trainer_plan(rank)
    plan2 = loads_plan(dumps_plan(plan))                 # same tasks, same order

Unknown format versions are a ValueError.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from scheduling.plan import Plan, TrainerGroup, TrainerPlan
from scheduling.tables import Interner
from weight_transfer.types import (
    EngineRankMeta,
    EngineTensorMeta,
    MeshDesc,
    ParamMeta,
    Piece,
    Placement,
    RankInfo,
    RegionDesc,
    ShardSpec,
    Transform,
    WriteTask,
)

FORMAT = 1
_COLUMNS = ("task_piece", "task_src", "task_dst", "task_region", "task_offset", "task_group",
            "trainer_ptr")


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


class _Dec:
    def __init__(self, strings: list[str]) -> None:
        self.s = strings

    def piece(self, v: list) -> Piece:
        s = self.s
        flat = v[5]
        return Piece(dst_tensor=s[v[0]], dst_offset=v[1], nbytes=v[2], dst_dtype=s[v[3]],
                     src_param=s[v[4]], src_slice=tuple(zip(flat[::2], flat[1::2], strict=True)),
                     transform=Transform(s[v[6]]))

    def region(self, v: list) -> RegionDesc:
        s = self.s
        return RegionDesc(owner=s[v[0]], nic=s[v[1]], addr=v[2], length=v[3], rkey=v[4],
                          transport=s[v[5]], node=s[v[6]])

    def mesh(self, v: list | None) -> MeshDesc | None:
        if v is None:
            return None
        return MeshDesc(ranks=tuple(v[0]), shape=tuple(v[1]),
                        dim_names=tuple(self.s[d] for d in v[2]))


def _pack(kind: str, body: dict[str, Any], enc: _Enc) -> bytes:
    return msgpack.packb(
        {"format": FORMAT, "kind": kind, "strings": enc.s.values, **body}, use_bin_type=True
    )


def _unpack(blob: bytes, kind: str) -> tuple[dict[str, Any], _Dec]:
    data = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("kind") != kind:
        got = (data.get("kind"), data.get("format")) if isinstance(data, dict) else type(data)
        raise ValueError(f"not a {kind} blob of format {FORMAT} (got {got})")
    return data, _Dec(data["strings"])


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
        groups.append([g.group, enc.mesh(g.mesh), [enc.s(n) for n in g.params], tasks])
    body = {
        "rank": tp.rank,
        "pieces": [enc.piece(p) for p in pieces],
        "regions": [enc.region(r) for r in regions],
        "groups": groups,
    }
    return _pack("trainer_plan", body, enc)


def loads_trainer_plan(blob: bytes) -> TrainerPlan:
    data, dec = _unpack(blob, "trainer_plan")
    pieces = [dec.piece(v) for v in data["pieces"]]
    regions = [dec.region(v) for v in data["regions"]]
    rank, groups = data["rank"], []
    for group, mesh, params, flat in data["groups"]:
        tasks = tuple(
            WriteTask(task_id=flat[i], mesh_group=group, src_rank=rank, piece=pieces[flat[i + 1]],
                      dst_replica=dec.s[flat[i + 2]], dst_rank=flat[i + 3],
                      region=regions[flat[i + 4]], region_offset=flat[i + 5])
            for i in range(0, len(flat), 6)
        )
        groups.append(TrainerGroup(group=group, mesh=dec.mesh(mesh),
                                   params=tuple(dec.s[p] for p in params), tasks=tasks))
    return TrainerPlan(rank=rank, groups=tuple(groups))


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
        "columns": {c: [str(getattr(plan, c).dtype), getattr(plan, c).astype(
            getattr(plan, c).dtype.newbyteorder("<")).tobytes()] for c in _COLUMNS},
    }
    body["meshes"] = [enc.mesh(m) for m in meshes]
    return _pack("plan", body, enc)


def loads_plan(blob: bytes) -> Plan:
    data, dec = _unpack(blob, "plan")
    s = dec.s
    meshes = [dec.mesh(m) for m in data["meshes"]]
    params = tuple(
        ParamMeta(name=s[n], shape=tuple(shape), dtype=s[dt], mesh=meshes[m],
                  placements=tuple(Placement(kind=s[k], dim=d) for k, d in pl))
        for n, shape, dt, m, pl in data["params"]
    )
    regions = tuple(dec.region(v) for v in data["regions"])
    engines = tuple(
        EngineRankMeta(
            replica=s[rep], rank=rank, node=s[node], nic=s[nic],
            shard=ShardSpec(tp_rank=sh[0], tp_size=sh[1], ep_rank=sh[2], ep_size=sh[3]),
            tensors=tuple(EngineTensorMeta(name=s[tn], shape=tuple(ts), dtype=s[td],
                                           region=regions[tr], offset=to)
                          for tn, ts, td, tr, to in tensors),
        )
        for rep, rank, node, nic, sh, tensors in data["engines"]
    )
    cols = {c: np.frombuffer(b, dtype=np.dtype(dt).newbyteorder("<")).astype(dt)
            for c, (dt, b) in data["columns"].items()}
    return Plan(
        params=params,
        trainer_ranks=tuple(RankInfo(rank=r, node=s[n], nic=s[c]) for r, n, c in data["ranks"]),
        engines=engines,
        pieces=tuple(dec.piece(v) for v in data["pieces"]),
        regions=regions,
        send_nics=tuple(s[i] for i in data["send_nics"]),
        recv_nics=tuple(s[i] for i in data["recv_nics"]),
        meshes=tuple(meshes[i] for i in data["sched_meshes"]),
        mesh_group=tuple(data["mesh_group"]),
        param_mesh=tuple(data["param_mesh"]),
        group_params=tuple(tuple(g) for g in data["group_params"]),
        **cols,
    )
