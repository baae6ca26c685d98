"""The FSDP2 source: parameters are DTensors (plain tensors count as replicated).

What :class:`~actors.trainer.TrainerMixin` did before sources had names, unchanged:
metadata from :func:`weight_transfer.model.live_metadata.param_metas_from_module`,
each parameter read from ``state_dict(keep_vars=True)`` at an update::

    source = Fsdp2Source(model, rank=r, world=n)
    source.param_metas()     # DTensor mesh and placements per parameter
    source.tensors()         # {canonical name: DTensor or tensor}
"""

from __future__ import annotations

from typing import Any

import torch

from weight_transfer.model.live_metadata import param_metas_from_module
from weight_transfer.model.naming import canonical_trainer_name
from weight_transfer.types import ParamMeta


class Fsdp2Source:
    """See the module docstring."""

    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, *, rank: int, world: int) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"trainer rank {rank}: the fsdp2 source takes a torch.nn.Module, "
                             f"not {type(model).__name__}")
        self.module, self.rank, self.world = model, rank, world

    @classmethod
    def recognizes(cls, model: Any) -> bool:
        return isinstance(model, torch.nn.Module)

    def check(self) -> None:
        """Nothing to refuse early: the planner checks names and shapes."""

    def param_metas(self) -> list[ParamMeta]:
        return param_metas_from_module(self.module)

    def tensors(self) -> dict[str, Any]:
        return {canonical_trainer_name(k): v
                for k, v in self.module.state_dict(keep_vars=True).items()}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as a full plain tensor (a collective: every rank calls)."""
        out = {}
        for name, t in self.module.state_dict().items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = full.detach().clone()
        return out
