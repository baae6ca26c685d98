"""Check a plan: every destination byte written exactly once, and nothing else.

``validate_plan(plan)`` (also ``plan.validate()``, which calls it: this module
does not import :mod:`scheduling.plan`) recomputes everything from
the plan's own data (engine metadata, pieces, task columns) and raises one
``ValueError`` listing up to 20 violations, each naming the engine replica,
rank, tensor and byte range (or the piece and parameter):

* pieces: source rectangle inside the trainer parameter, byte size that the
  transform and destination dtype imply, destination dtype of the transform;
* tasks: the engine rank exposes the tensor, dtypes agree, the write lands at
  the tensor's offset in its region and inside the region, the source rank
  belongs to the parameter's mesh and the task sits in that mesh's group;
* coverage: per engine tensor, the written ranges tile [0, nbytes) exactly -
  no gap, no overlap; tensors of one region do not overlap each other;
* shard-direct parameters (``plan.direct_params``): every task of one reads
  a rectangle inside the block (or ZeRO-3 flat range) its source rank holds
  (:func:`weight_transfer.layout.shard_blocks.holds`), since it is written from
  what the rank holds with no gather.

Per-task checks are vectorized; per-piece checks loop over distinct pieces.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scheduling.build.tables import engine_table, grow_lookup, piece_table
from weight_transfer.layout.fp8_geometry import FP8_DTYPE, SCALE_DTYPE
from weight_transfer.layout.shard_blocks import held, holds
from weight_transfer.plan.check import expected_piece_nbytes
from weight_transfer.plan.wire import Interner
from weight_transfer.types import Piece, Transform

# A scheduling.plan.Plan. Not imported, not even for typing: plan.py imports this
# module for Plan.validate(), and the import graph stays one-way.
PlanData = Any

MAX_SHOWN = 20


_TRANSFORM_DTYPES = {Transform.FP8_WEIGHT: (FP8_DTYPE,), Transform.FP8_SCALE: (SCALE_DTYPE,)}


def _piece_problem(piece: Piece, shape: tuple[int, ...] | None) -> tuple[str, ...]:
    """What is wrong with ``piece``, its parameter of ``shape`` (None: no parameter)."""
    if shape is None:
        return (f"no trainer parameter {piece.src_param!r}",)
    sl = piece.src_slice
    if len(sl) != len(shape) or any(
        not 0 <= a < b <= d for (a, b), d in zip(sl, shape, strict=False)
    ):
        return (f"source slice {sl} is not inside shape {shape}",)
    problems = []
    allowed = _TRANSFORM_DTYPES.get(piece.transform)
    if allowed and piece.dst_dtype not in allowed:
        problems.append(f"{piece.transform} writes {allowed[0]}, not {piece.dst_dtype}")
    want = expected_piece_nbytes(piece)
    if want != piece.nbytes:
        problems.append(f"{piece.nbytes} B but its slice and dtype make {want} B")
    return tuple(problems)


def _piece_problems(plan: PlanData) -> list[str]:
    out: list[str] = []
    shapes = {p.name: p.shape for p in plan.params}
    # Pieces repeat (every expert of a layer, every layer): check each parameter
    # shape, slice, transform, dtype and size once.
    seen: dict[tuple, tuple[str, ...]] = {}
    for k, piece in enumerate(plan.pieces):
        shape = shapes.get(piece.src_param)
        key = (shape, piece.src_slice, piece.transform, piece.dst_dtype, piece.nbytes)
        problems = seen.get(key)
        if problems is None:
            problems = _piece_problem(piece, shape)
            if shape is not None:  # the message of a missing parameter names it
                seen[key] = problems
        if not problems:
            continue
        where = f"piece {k} ({piece.dst_tensor} @ {piece.dst_offset}, from {piece.src_param})"
        out.extend(f"{where}: {p}" for p in problems)
        if len(out) >= MAX_SHOWN:
            break
    return out


def _where(plan: PlanData, names: Interner, engine: int, name: int) -> str:
    e = plan.engines[engine]
    return f"{e.replica} rank {e.rank} tensor {names.values[name]}"


def _task_problems(plan: PlanData, et, pt, names: Interner, rows: np.ndarray) -> list[str]:
    out: list[str] = []
    tp = plan.task_piece
    nb = pt.nbytes[tp]

    def report(mask: np.ndarray, what) -> None:
        for i in np.flatnonzero(mask)[: MAX_SHOWN - len(out)]:
            out.append(what(int(i)))

    missing = rows < 0
    report(missing, lambda i: f"{_where(plan, names, plan.task_dst[i], pt.name[tp[i]])}: "
           "the engine rank does not expose this tensor")
    r = np.where(missing, 0, rows)
    ok = ~missing
    report(ok & (et.dtype[r] != pt.dtype[tp]),
           lambda i: f"{_where(plan, names, plan.task_dst[i], pt.name[tp[i]])}: dtype of the "
           f"piece ({plan.pieces[tp[i]].dst_dtype}) differs from the tensor's")
    lengths = np.array([g.length for g in plan.regions], dtype=np.int64)
    outside = (plan.task_offset < 0) | (plan.task_offset + nb > lengths[plan.task_region])
    report(outside, lambda i: f"{_where(plan, names, plan.task_dst[i], pt.name[tp[i]])}: write "
           f"[{plan.task_offset[i]}, {plan.task_offset[i] + nb[i]}) outside "
           f"{plan.regions[plan.task_region[i]].describe()}")
    misplaced = ok & ((plan.task_region != et.region[r])
                      | (plan.task_offset != et.offset[r] + pt.offset[tp]))
    report(misplaced, lambda i: f"{_where(plan, names, plan.task_dst[i], pt.name[tp[i]])}: task "
           f"{i} writes region offset {plan.task_offset[i]}, the tensor's bytes "
           f"[{pt.offset[tp[i]]}, {pt.offset[tp[i]] + nb[i]}) live at "
           f"{et.offset[r[i]] + pt.offset[tp[i]]}")
    member = np.zeros((len(plan.meshes), len(plan.trainer_ranks)), dtype=bool)
    for m, mesh in enumerate(plan.meshes):
        strangers = [r for r in mesh.ranks if not 0 <= r < len(plan.trainer_ranks)]
        if strangers:
            return [*out, f"mesh {m}: ranks {strangers} are not trainer ranks of the plan "
                    f"(0..{len(plan.trainer_ranks) - 1})"]
        member[m, list(mesh.ranks)] = True
    mesh = np.asarray(plan.param_mesh)[pt.param[tp]]
    report(~member[mesh, plan.task_src], lambda i: f"task {i}: source rank {plan.task_src[i]} is "
           f"not in the mesh of {plan.pieces[tp[i]].src_param}")
    report(np.asarray(plan.mesh_group)[mesh] != plan.task_group,
           lambda i: f"task {i}: in mesh group {plan.task_group[i]}, its mesh is in group "
           f"{plan.mesh_group[mesh[i]]}")
    if np.any(np.diff(plan.task_src) < 0) or len(plan.trainer_ptr) != len(plan.trainer_ranks) + 1:
        out.append("task rows are not ordered by source rank as trainer_ptr says")
    return out


def _coverage_problems(plan: PlanData, et, pt, names: Interner, rows: np.ndarray) -> list[str]:
    out: list[str] = []
    ok = rows >= 0
    row, start = rows[ok], pt.offset[plan.task_piece[ok]]
    end = start + pt.nbytes[plan.task_piece[ok]]
    order = np.lexsort((start, row))
    row, start, end = row[order], start[order], end[order]
    prev_end = np.concatenate(([0], end[:-1]))
    first = np.concatenate(([True], row[1:] != row[:-1]))
    prev_end[first] = 0
    last = np.concatenate((row[1:] != row[:-1], [True]))

    def name(t: int) -> str:
        return _where(plan, names, int(et.engine[t]), int(et.name[t]))

    for i in np.flatnonzero(start != prev_end)[:MAX_SHOWN]:
        lo, hi = sorted((int(prev_end[i]), int(start[i])))
        kind = "not written" if start[i] > prev_end[i] else "written more than once"
        out.append(f"{name(row[i])}: bytes [{lo}, {hi}) {kind}")
    tail = last & (end != et.nbytes[row])
    for i in np.flatnonzero(tail)[: MAX_SHOWN - len(out)]:
        n = int(et.nbytes[row[i]])
        kind = "not written" if end[i] < n else "written past the tensor's end"
        out.append(f"{name(row[i])}: bytes [{min(n, end[i])}, {max(n, end[i])}) {kind}")
    unwritten = np.setdiff1d(np.arange(len(et.engine)), row)
    for t in unwritten[: MAX_SHOWN - len(out)]:
        out.append(f"{name(t)}: bytes [0, {et.nbytes[t]}) not written (no task)")
    by_region = np.lexsort((et.offset, et.region))
    reg, off, size = et.region[by_region], et.offset[by_region], et.nbytes[by_region]
    clash = np.flatnonzero((reg[1:] == reg[:-1]) & (off[1:] < off[:-1] + size[:-1]))
    for i in clash[: MAX_SHOWN - len(out)]:
        out.append(f"{name(by_region[i + 1])} overlaps {name(by_region[i])} in "
                   f"{plan.regions[reg[i]].describe()}")
    return out


def _direct_problems(plan: PlanData, pt) -> list[str]:
    direct_params = getattr(plan, "direct_params", ())
    if not direct_params:
        return []
    direct = np.zeros(len(plan.params), dtype=bool)
    direct[list(direct_params)] = True
    rows = np.flatnonzero(direct[pt.param[plan.task_piece]])
    pairs = np.unique(plan.task_piece[rows].astype(np.int64) * len(plan.trainer_ranks)
                      + plan.task_src[rows])
    out: list[str] = []
    for key in pairs.tolist():
        piece, rank = plan.pieces[key // len(plan.trainer_ranks)], key % len(plan.trainer_ranks)
        meta = plan.params[int(pt.param[key // len(plan.trainer_ranks)])]
        if not holds(meta, rank, piece.src_slice):
            out.append(f"shard-direct piece {piece.src_param}{list(piece.src_slice)} -> "
                       f"{piece.dst_tensor}@{piece.dst_offset}: source rank {rank} holds "
                       f"{held(meta, rank)} of it")
            if len(out) >= MAX_SHOWN:
                break
    return out


def validate_plan(plan: PlanData) -> None:
    """Raise ValueError listing violations (see the module docstring); return None if sound."""
    problems = _piece_problems(plan)
    names, dtypes = Interner(), Interner()
    index = {p.name: i for i, p in enumerate(plan.params)}
    if not problems:
        pt = piece_table(plan.pieces, index, names, dtypes)
        et = engine_table(plan.engines, names, dtypes)
        rows = grow_lookup(et, len(names))[plan.task_dst, pt.name[plan.task_piece]]
        problems = _task_problems(plan, et, pt, names, rows)
        problems += _coverage_problems(plan, et, pt, names, rows)
        problems += _direct_problems(plan, pt)
    if problems:
        shown = problems[:MAX_SHOWN]
        more = "" if len(problems) <= MAX_SHOWN else "\n  ..."
        raise ValueError(
            f"plan is invalid ({len(shown)} problem(s) shown):\n  " + "\n  ".join(shown) + more
        )
