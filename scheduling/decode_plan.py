"""Checked decoding of a whole plan blob (:func:`scheduling.serialize.loads_plan`).

Metadata (parameters, trainer ranks, engines with their tensors and regions)
is checked field by field (:mod:`weight_transfer.integrity.receipt`); the task columns
must be integer arrays of one length, every index inside its table, the
trainer pointer a partition of the rows by source rank, and every task inside
its region. What a column or index error names: the column, the first bad row
and its value. :meth:`Plan.validate` (run by ``loads_plan`` by default) then
checks the plan's meaning: every destination byte written exactly once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scheduling.build.direct import GATHER_MODES
from scheduling.plan import Plan
from weight_transfer.integrity.receipt import (
    check_engine_meta,
    check_int,
    check_param_meta,
    check_shard,
    check_str,
)
from weight_transfer.plan.decode import Reader
from weight_transfer.types import (
    EngineRankId,
    EngineRankMeta,
    EngineTensorMeta,
    ParamMeta,
    Placement,
    RankInfo,
    ShardSpec,
)

COLUMNS = ("task_piece", "task_src", "task_dst", "task_region", "task_offset", "task_group",
           "trainer_ptr")
_INT_DTYPES = {f"{k}{n}" for k in ("int", "uint") for n in (8, 16, 32, 64)}


def _unchecked(cls: type, **fields: Any) -> Any:
    """A frozen dataclass without its ``__post_init__``: the receipt checks name the field."""
    obj = cls.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


def _params(rd: Reader, data: dict, meshes: list) -> tuple[ParamMeta, ...]:
    out, names = [], set()
    for i, v in enumerate(rd.list(data, "params")):
        name, shape, dt, m, pl = rd.list(v, f"params[{i}]", 5)
        placements = []
        for j, x in enumerate(rd.list(pl, f"params[{i}]: placements")):
            kind, dim = rd.list(x, f"params[{i}]: placements[{j}]", 2)
            placements.append(_unchecked(Placement, kind=rd.str(kind, "placement kind"),
                                         dim=dim))
        p = ParamMeta(name=rd.str(name, f"params[{i}]: name"),
                      shape=rd.ints(shape, f"params[{i}]: shape"),
                      dtype=rd.str(dt, f"params[{i}]: dtype"),
                      mesh=meshes[rd.index(m, meshes, f"params[{i}]: mesh")],
                      placements=tuple(placements))
        check_param_meta(p, f"plan blob: params[{i}]")
        if p.name in names:
            raise ValueError(f"plan blob: parameter {p.name!r} is listed twice")
        names.add(p.name)
        out.append(p)
    return tuple(out)


def _engines(rd: Reader, data: dict, regions: tuple) -> tuple[EngineRankMeta, ...]:
    out, seen = [], set()
    for i, v in enumerate(rd.list(data, "engines")):
        where = f"engines[{i}]"
        rep, rank, node, nic, sh, tensors = rd.list(v, where, 6)
        shard = _unchecked(ShardSpec, **dict(zip(("tp_rank", "tp_size", "ep_rank", "ep_size"),
                                                 rd.ints(sh, f"{where}: shard"), strict=False)))
        check_shard(shard, f"plan blob: {where}")
        ts = []
        for j, t in enumerate(rd.list(tensors, f"{where}: tensors")):
            tn, shape, td, tr, off = rd.list(t, f"{where}: tensors[{j}]", 5)
            ts.append(EngineTensorMeta(
                name=rd.str(tn, f"{where}: tensors[{j}]: name"),
                shape=rd.ints(shape, f"{where}: tensors[{j}]: shape"),
                dtype=rd.str(td, f"{where}: tensors[{j}]: dtype"),
                region=regions[rd.index(tr, regions, f"{where}: tensors[{j}]: region")],
                offset=off))
        e = EngineRankMeta(replica=rd.str(rep, f"{where}: replica"), rank=rank,
                           node=rd.str(node, f"{where}: node"), nic=rd.str(nic, f"{where}: nic"),
                           shard=shard, tensors=tuple(ts))
        check_engine_meta(e, f"plan blob: {where} ({EngineRankId(replica=e.replica, rank=rank)})")
        if (e.replica, e.rank) in seen:
            raise ValueError(f"plan blob: engine {e.id} is listed twice")
        seen.add((e.replica, e.rank))
        out.append(e)
    return tuple(out)


def _columns(rd: Reader, data: dict) -> dict[str, np.ndarray]:
    raw = rd.field(data, "columns")
    if not isinstance(raw, dict) or set(raw) != set(COLUMNS):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"plan blob: columns must be {list(COLUMNS)}, not {got}")
    cols = {}
    for c in COLUMNS:
        dt, b = rd.list(raw[c], f"columns.{c}", 2)
        if dt not in _INT_DTYPES or not isinstance(b, bytes):
            raise ValueError(f"plan blob: column {c} must be an integer dtype and bytes, not "
                             f"({dt!r}, {type(b).__name__})")
        le = np.dtype(dt).newbyteorder("<")
        if len(b) % le.itemsize:
            raise ValueError(f"plan blob: column {c}: {len(b)} B is not a whole number of {dt}")
        cols[c] = np.frombuffer(b, dtype=le).astype(dt)
    return cols


def _check_column(cols: dict, name: str, hi: int) -> None:
    col = cols[name].astype(np.int64) if cols[name].dtype != np.uint64 else cols[name]
    bad = np.flatnonzero((col < 0) | (col > hi)) if len(col) else []
    if len(bad):
        row = int(bad[0])
        raise ValueError(f"plan blob: column {name} row {row}: {int(cols[name][row])} is not in "
                         f"[0, {hi}]")


def _check_tasks(cols: dict, plan_parts: dict) -> None:
    n = len(cols["task_piece"])
    lengths = {c: len(cols[c]) for c in COLUMNS if c != "trainer_ptr"}
    if set(lengths.values()) != {n}:
        raise ValueError(f"plan blob: task columns differ in length: {lengths}")
    limits = {"task_piece": len(plan_parts["pieces"]) - 1,
              "task_src": len(plan_parts["trainer_ranks"]) - 1,
              "task_dst": len(plan_parts["engines"]) - 1,
              "task_region": len(plan_parts["regions"]) - 1,
              "task_group": len(plan_parts["group_params"]) - 1,
              "task_offset": 1 << 62, "trainer_ptr": n}
    for c, hi in limits.items():
        _check_column(cols, c, hi)
    ptr = cols["trainer_ptr"].astype(np.int64)
    ranks = len(plan_parts["trainer_ranks"])
    if len(ptr) != ranks + 1 or ptr[0] != 0 or ptr[-1] != n or np.any(np.diff(ptr) < 0):
        raise ValueError(f"plan blob: trainer_ptr {ptr[:8].tolist()}... must rise from 0 to "
                         f"{n} in {ranks + 1} entries")
    src = cols["task_src"].astype(np.int64)
    if n and not np.array_equal(src, np.repeat(np.arange(ranks), np.diff(ptr))):
        raise ValueError("plan blob: task_src does not match trainer_ptr (rows of a rank "
                         "must be contiguous, in rank order)")
    sizes = np.array([p.nbytes for p in plan_parts["pieces"]], dtype=np.int64)
    lengths_r = np.array([r.length for r in plan_parts["regions"]], dtype=np.int64)
    if n:
        end = cols["task_offset"].astype(np.int64) + sizes[cols["task_piece"].astype(np.int64)]
        over = np.flatnonzero(end > lengths_r[cols["task_region"].astype(np.int64)])
        if len(over):
            raise ValueError(f"plan blob: task {int(over[0])} ends at byte {int(end[over[0]])}, "
                             "outside its region")


def _direct(rd: Reader, data: dict, parts: dict) -> None:
    """The gather mode, shard-direct parameters and fallbacks (absent: a "full" plan)."""
    n = len(parts["params"])
    gather = rd.str(data["gather"], "gather") if "gather" in data else "full"
    if gather not in GATHER_MODES:
        raise ValueError(f"plan blob: gather must be one of {GATHER_MODES}, not {gather!r}")
    direct = rd.ints(data.get("direct_params", []), "direct_params", hi=max(n - 1, 0))
    if (n == 0 and direct) or list(direct) != sorted(set(direct)):
        raise ValueError("plan blob: direct_params must be ascending parameter indices")
    fallback = []
    for i, v in enumerate(rd.list(data.get("fallback", []), "fallback")):
        p, reason = rd.list(v, f"fallback[{i}]", 2)
        fallback.append((check_int(p, f"plan blob: fallback[{i}]", hi=max(n - 1, 0)),
                         rd.str(reason, f"fallback[{i}]: reason")))
    if gather == "full" and direct:
        raise ValueError("plan blob: a plan of gather mode 'full' lists direct_params")
    parts.update(gather=gather, direct_params=tuple(direct), fallback=tuple(fallback))


def decode_plan(data: dict, rd: Reader) -> Plan:
    """A :class:`Plan` from a decoded plan blob, every field checked (see the docstring)."""
    meshes = [rd.mesh(m, f"meshes[{i}]") for i, m in enumerate(rd.list(data, "meshes"))]
    if any(m is None for m in meshes):
        raise ValueError("plan blob: meshes must not hold null")
    regions = tuple(rd.region(v, f"regions[{i}]") for i, v in enumerate(rd.list(data, "regions")))
    ranks = []
    for i, v in enumerate(rd.list(data, "ranks")):
        r, node, nic = rd.list(v, f"ranks[{i}]", 3)
        if r != i:
            raise ValueError(f"plan blob: ranks[{i}] is rank {r!r}; trainer ranks run 0..n-1")
        ranks.append(RankInfo(rank=r, node=rd.str(node, f"ranks[{i}]: node"),
                              nic=check_str(rd.str(nic, f"ranks[{i}]: nic"), "nic")))
    parts = {
        "params": _params(rd, data, meshes), "trainer_ranks": tuple(ranks),
        "engines": _engines(rd, data, regions), "regions": regions,
        "pieces": tuple(rd.piece(v, f"pieces[{i}]") for i, v in enumerate(rd.list(data, "pieces"))),
        "send_nics": tuple(rd.str(i, "send_nics") for i in rd.list(data, "send_nics")),
        "recv_nics": tuple(rd.str(i, "recv_nics") for i in rd.list(data, "recv_nics")),
        "meshes": tuple(meshes[rd.index(i, meshes, "sched_meshes")]
                        for i in rd.list(data, "sched_meshes")),
    }
    for field, nics, need in (("send_nics", parts["send_nics"], {r.nic for r in ranks}),
                              ("recv_nics", parts["recv_nics"],
                               {e.nic for e in parts["engines"]})):
        if len(set(nics)) != len(nics) or not need <= set(nics):
            raise ValueError(f"plan blob: {field} {list(nics)[:8]} must be distinct and name "
                             f"{sorted(need)[:8]}")
    groups = tuple(rd.ints(g, f"group_params[{i}]", hi=len(parts["params"]) - 1)
                   for i, g in enumerate(rd.list(data, "group_params")))
    parts["group_params"] = groups
    parts["mesh_group"] = rd.ints(rd.field(data, "mesh_group"), "mesh_group",
                                  hi=max(len(groups) - 1, 0))
    parts["param_mesh"] = rd.ints(rd.field(data, "param_mesh"), "param_mesh",
                                  hi=max(len(parts["meshes"]) - 1, 0))
    if len(parts["mesh_group"]) != len(parts["meshes"]) or \
            len(parts["param_mesh"]) != len(parts["params"]):
        raise ValueError("plan blob: mesh_group must have one entry per mesh and param_mesh "
                         "one per parameter")
    _direct(rd, data, parts)
    cols = _columns(rd, data)
    _check_tasks(cols, parts)
    check_int(len(cols["task_piece"]), "plan blob: task count")
    return Plan(**parts, **cols)
