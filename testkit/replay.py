"""Replay a plan in memory: the reference executor for tests and dry runs.

Each trainer's :class:`~scheduling.plan.TrainerPlan` is run the way a real
trainer runs it - per mesh group, per parameter in the group's gather order,
``prepare_piece`` on the full parameter, then the bytes copied into the
destination region at the task's offset - except that the "remote" regions are
local byte buffers. The result is every engine rank's tensors as raw bytes::

    engines = replay_in_memory(plan, full_state)          # {(replica, rank): {name: uint8}}
    engines[("engine0", 1)]["model.layers.0.self_attn.qkv_proj.weight"]

A task whose parameter is not in its group's gather order, a prepared piece of
the wrong size, or a write outside its region is a ValueError: a real
executor would never gather that parameter, or the NIC would refuse the write.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch

from scheduling.plan import Plan, TrainerPlan
from weight_transfer.prepare import piece_bytes
from weight_transfer.types import RegionDesc


def _run_trainer(tp: TrainerPlan, state: Mapping[str, torch.Tensor], buffers) -> None:
    for group in tp.groups:
        by_param: dict[str, list] = defaultdict(list)
        for t in group.tasks:
            by_param[t.piece.src_param].append(t)
        stray = sorted(set(by_param) - set(group.params))
        if stray:
            raise ValueError(
                f"trainer {tp.rank} group {group.group}: tasks read parameters it never "
                f"gathers: {stray[:10]}"
            )
        for name in group.params:
            prepared: dict = {}  # a piece going to several replicas is prepared once
            for t in by_param.get(name, ()):
                data = prepared.get(t.piece)
                if data is None:
                    data = prepared[t.piece] = piece_bytes(state[name], t.piece)
                if data.numel() != t.nbytes:
                    raise ValueError(
                        f"task {t.task_id}: prepared {data.numel()} B, the piece says {t.nbytes}"
                    )
                buf = buffers[t.region]
                end = t.region_offset + t.nbytes
                if t.region_offset < 0 or end > buf.numel():
                    raise ValueError(
                        f"task {t.task_id}: write [{t.region_offset}, {end}) outside "
                        f"{t.region.describe()}"
                    )
                buf[t.region_offset : end] = data


def replay_in_memory(
    plan: Plan,
    state: Mapping[str, torch.Tensor],
    *,
    trainer_plans: Iterable[TrainerPlan] | None = None,
) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """Run all trainers' tasks into zeroed region buffers; return engine tensors as bytes.

    ``trainer_plans`` defaults to ``plan.trainer_plan(r)`` for every rank; pass
    deserialized ones to check what trainers actually receive.
    """
    buffers: dict[RegionDesc, torch.Tensor] = {
        r: torch.zeros(r.length, dtype=torch.uint8) for r in plan.regions
    }
    if trainer_plans is None:
        trainer_plans = (plan.trainer_plan(r.rank) for r in plan.trainer_ranks)
    for tp in trainer_plans:
        _run_trainer(tp, state, buffers)
    out: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for e in plan.engines:
        out[(e.replica, e.rank)] = {
            t.name: buffers[t.region][t.offset : t.offset + t.nbytes] for t in e.tensors
        }
    return out
