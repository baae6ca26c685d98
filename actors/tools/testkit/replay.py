"""Replay a plan in memory: the reference executor for tests and dry runs.

Each trainer's :class:`~weight_transfer.plan.types.TrainerPlan` is run the way a real
trainer runs it - per mesh group, per parameter in the group's gather order,
``prepare_piece`` on the full parameter, then the bytes copied into the
destination region at the task's offset - except that the "remote" regions are
local byte buffers. A shard-direct parameter (the group's ``local``) is cut from
the rank's own block of it (:func:`weight_transfer.layout.shard_blocks.local_rect`: the
block the rank's DTensor holds) with the pieces shifted into it, as the executor
does, so a piece that needs bytes outside that block fails. The result is every
engine rank's tensors as raw bytes::

    engines = replay_in_memory(plan, full_state)          # {(replica, rank): {name: uint8}}
    engines[("engine0", 1)]["model.layers.0.self_attn.qkv_proj.weight"]

Each trainer plan first passes the executor's own check
(:func:`weight_transfer.sender.executor.check_trainer_plan`: known parameters, tasks
of this rank and group, no task whose parameter the group never gathers); a
prepared piece of the wrong size or a write outside its region is a ValueError
too: the NIC would refuse that write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from scheduling.plan import Plan
from weight_transfer.layout.shard_blocks import local_rect, shifted
from weight_transfer.plan.types import TrainerPlan
from weight_transfer.sender.executor import check_trainer_plan
from weight_transfer.sender.prepare import piece_bytes
from weight_transfer.types import ParamMeta, RegionDesc


def _run_trainer(tp: TrainerPlan, params: Sequence[ParamMeta],
                 state: Mapping[str, torch.Tensor], buffers) -> None:
    for group in check_trainer_plan(tp, params):
        local = {m.name for m in group.local}
        for meta in (*group.local, *group.params):
            name = meta.name
            source, block = state[name], None
            if name in local:  # the rank's own block, as DTensor.to_local() holds it
                block = local_rect(meta, tp.rank)
                source = source[tuple(slice(a, b) for a, b in block)].clone()
            prepared: dict = {}  # a piece going to several replicas is prepared once
            for t in group.tasks.get(name, ()):
                data = prepared.get(t.piece)
                if data is None:
                    piece = t.piece if block is None else shifted(t.piece, block)
                    data = prepared[t.piece] = piece_bytes(source, piece)
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
        _run_trainer(tp, plan.params, state, buffers)
    out: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for e in plan.engines:
        out[(e.replica, e.rank)] = {
            t.name: buffers[t.region][t.offset : t.offset + t.nbytes] for t in e.tensors
        }
    return out
