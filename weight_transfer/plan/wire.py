"""msgpack round trip of one trainer's :class:`~weight_transfer.plan.types.TrainerPlan`.

The encoding is compact: every string (parameter, tensor, NIC, owner names, dtypes) is
stored once in a string table and referred to by index; pieces and regions are stored once
and tasks refer to them by index. Decoding checks every field before use
(:mod:`weight_transfer.plan.decode`): a corrupt blob, an unknown format version, a negative
or overflowing size, an index outside its table, an unknown dtype or transform, a task
outside its region is a ValueError naming the field::

    blob = dumps_trainer_plan(plan.trainer_plan(rank))   # what trainer ``rank`` receives
    assert loads_trainer_plan(blob) == plan.trainer_plan(rank)

:mod:`scheduling.serialize` encodes a whole plan with the same :class:`Encoder`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from weight_transfer.integrity.receipt import check_int
from weight_transfer.plan.decode import FORMAT, Reader, check_tasks, unpack
from weight_transfer.plan.types import TrainerGroup, TrainerPlan
from weight_transfer.types import MeshDesc, Piece, RegionDesc, WriteTask


class Interner:
    """Strings to dense integer ids, in order of first appearance."""

    __slots__ = ("ids", "values")

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.values: list[str] = []

    def __call__(self, value: str) -> int:
        # One dict lookup on the hot path (millions of calls when planning Kimi-K2).
        i = self.ids.setdefault(value, len(self.ids))
        if i == len(self.values):
            self.values.append(value)
        return i

    def many(self, values: Sequence[str]) -> np.ndarray:
        """Ids of ``values`` (interned in order of first appearance, as one call each)."""
        ids = {v: self(v) for v in dict.fromkeys(values)}
        return np.fromiter(map(ids.__getitem__, values), np.int64, count=len(values))

    def __len__(self) -> int:
        return len(self.values)


class Encoder:
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


def pack(kind: str, body: dict[str, Any], enc: Encoder) -> bytes:
    """The blob of ``kind``: format, kind, the string table and ``body``."""
    return msgpack.packb(
        {"format": FORMAT, "kind": kind, "strings": enc.s.values, **body}, use_bin_type=True
    )


def dumps_trainer_plan(tp: TrainerPlan) -> bytes:
    """Encode what one trainer receives; pieces and regions deduplicated by index."""
    enc = Encoder()
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
    return pack("trainer_plan", body, enc)


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
