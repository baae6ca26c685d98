"""The DeepSpeed source: a trainer rank of a ZeRO engine describes its parameters live.

Attach the ``DeepSpeedEngine`` (or its model, once ZeRO-3 partitioned it, e.g. built
under ``deepspeed.zero.Init``); nothing of DeepSpeed is imported, the parameters'
own ZeRO attributes are read:

* **ZeRO-3**: every parameter keeps a flat 1/N slice of the flattened parameter in
  ``param.ds_tensor`` (``param.ds_shape`` the full shape; the last slice padded).
  Each becomes ``Placement(kind="flat")`` on a 1-D mesh of the partition group's
  ranks, so the plan writes every rank's slice straight from ``ds_tensor``
  (whole rows, partial rows at the edges; :mod:`scheduling.build.direct_flat`) and
  gathers, one collective per bucket, only the parameters it cannot
  (:func:`weight_transfer.sender.flat_shard.gather_flat`). A partition offloaded to
  the host (``offload_param: cpu``) is read there.
* **ZeRO-0/1/2**: every rank holds every parameter whole: replicated, so the plan
  spreads the writes over every rank's NIC.

Refused when attached (ValueError naming the parameter, the rank and what is
missing; nothing is registered or written): a ZeRO stage this source does not
know, a parameter ZeRO-3 did not partition (or partitioned over another group, or
with another partition size), partitions over a subset of the trainer ranks
(MiCS, hierarchical), parameters swapped to NVMe, and a parameter that no name
table of the model's architecture maps (its Hugging Face ``.config``). A model that
wraps the Hugging Face model (OpenRLHF's ``Actor.model``) is described by the
wrapped model, under its own names::

    source = DeepSpeedSource(engine, rank=r, world=n)
    source.param_metas()       # Flat() on the partition group, or replicated
    source.tensors()           # {name: FlatShard over ds_tensor, or the full tensor}
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from weight_transfer.layout.flat_blocks import FLAT, partition_numel
from weight_transfer.model.live_metadata import dtype_name, expert_naming_of
from weight_transfer.model.naming import canonical_trainer_name, unmapped_trainer_names
from weight_transfer.sender.flat_shard import FlatShard
from weight_transfer.types import MeshDesc, ParamMeta, Placement

log = logging.getLogger(__name__)

KNOWN_STAGES = (0, 1, 2, 3)
_REPLICATE = (Placement(kind="replicate"),)


def is_engine(obj: Any) -> bool:
    """A ``DeepSpeedEngine`` (duck-typed: its ZeRO stage and its wrapped module)."""
    return (callable(getattr(obj, "zero_optimization_stage", None))
            and isinstance(getattr(obj, "module", None), torch.nn.Module))


def is_partitioned(p: Any) -> bool:
    return getattr(p, "ds_tensor", None) is not None


def swapped_out(part: Any) -> bool:
    """A ZeRO-3 partition (a parameter's ``ds_tensor``) that is not in memory now: swapped
    out to NVMe (``offload_param.device nvme``)."""
    return str(getattr(part, "status", "") or "").upper().endswith("NOT_AVAILABLE")


def hf_root(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the Hugging Face model inside ``module``, its name prefix): ``module`` itself when
    it has a ``.config``, else its first submodule that has one (OpenRLHF's
    ``Actor.model``), else ``module`` with no config."""
    if getattr(module, "config", None) is not None:
        return module, ""
    for name, sub in module.named_modules():
        if name and hasattr(getattr(sub, "config", None), "to_dict"):
            return sub, name + "."
    return module, ""


class DeepSpeedSource:
    """See the module docstring."""

    name = "deepspeed"

    def __init__(self, model: Any, *, rank: int, world: int) -> None:
        self.engine = model if is_engine(model) else None
        outer = self.engine.module if self.engine is not None else model
        if not isinstance(outer, torch.nn.Module):
            raise ValueError(f"trainer rank {rank}: the deepspeed source takes a DeepSpeed "
                             f"engine or a torch.nn.Module, not {type(model).__name__}")
        self.rank, self.world, self.outer = rank, world, outer
        self.module, self.prefix = hf_root(outer)
        self.stage = self._stage()
        self._check_engine()
        self._group_ranks: dict[int, tuple[int, ...]] = {}

    @classmethod
    def recognizes(cls, model: Any) -> bool:
        if is_engine(model):
            return True
        return isinstance(model, torch.nn.Module) and any(
            is_partitioned(p) for p in model.parameters())

    # ------------------------------------------------------------------ what the engine is

    def _where(self) -> str:
        return f"trainer rank {self.rank} (deepspeed source)"

    def _stage(self) -> int:
        """The ZeRO stage: the engine's, or 3 for a partitioned model, else 0."""
        if self.engine is not None:
            stage = self.engine.zero_optimization_stage()
            if stage not in KNOWN_STAGES:
                raise ValueError(f"{self._where()}: ZeRO stage {stage!r} is not one this "
                                 f"source knows ({', '.join(map(str, KNOWN_STAGES))})")
            return int(stage)
        return 3 if any(is_partitioned(p) for p in self.outer.parameters()) else 0

    def _check_engine(self) -> None:
        offload = None
        if self.engine is not None and callable(getattr(self.engine, "zero_offload_param",
                                                        None)):
            offload = self.engine.zero_offload_param()
        device = str(getattr(offload, "device", "") or "").lower()
        if device.endswith("nvme"):
            raise ValueError(f"{self._where()}: ZeRO-3 parameters are offloaded to NVMe "
                             "(offload_param.device nvme); the source reads partitions from "
                             "device or host memory only (offload_param: cpu)")
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            got = (dist.get_rank(), dist.get_world_size())
            if got != (self.rank, self.world):
                raise ValueError(f"{self._where()}: torch.distributed says rank {got[0]} of "
                                 f"{got[1]}, wt_attach was given rank {self.rank} of "
                                 f"{self.world}; ZeRO partition groups are named by global "
                                 "ranks, so the two must agree")

    def check(self) -> None:
        """Every refusal of the module docstring, before anything is set up."""
        self.param_metas()

    # ------------------------------------------------------------------ parameters

    def _entries(self) -> list[tuple[str, torch.Tensor]]:
        """(canonical name, tensor) of every parameter and persistent buffer of the
        Hugging Face model, each tensor once (tied weights under their first name);
        ValueError for a parameter of the attached model outside it."""
        inside = {id(p) for p in self.module.parameters()}
        stray = [n for n, p in self.outer.named_parameters() if id(p) not in inside]
        if stray:
            raise ValueError(f"{self._where()}: parameter {stray[0]!r} lies outside the "
                             f"Hugging Face model ({self.prefix.rstrip('.') or 'the root'}) "
                             f"whose name table the plan uses: no name table maps it "
                             f"({len(stray)} such parameters)")
        seen: set[int] = set()
        out = []
        for raw, t in self.module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            seen.add(id(t))
            out.append((canonical_trainer_name(raw), t))
        return out

    def _ranks(self, name: str, p: torch.Tensor) -> tuple[int, ...]:
        """The global ranks of ``p``'s partition group, in group order."""
        group = getattr(p, "ds_process_group", None)
        key = id(group)
        if key not in self._group_ranks:
            dist = torch.distributed
            if group is None or not (dist.is_available() and dist.is_initialized()):
                ranks = tuple(range(self.world))
            else:
                ranks = tuple(dist.get_process_group_ranks(group))
                ranks = tuple(sorted(ranks, key=lambda g: dist.get_group_rank(group, g)))
            self._group_ranks[key] = ranks
        ranks = self._group_ranks[key]
        if sorted(ranks) != list(range(self.world)):
            raise ValueError(f"{self._where()}: parameter {name!r} is partitioned over ranks "
                             f"{list(ranks)}, not over every trainer rank 0..{self.world - 1} "
                             "(MiCS or a hierarchical partition): a partitioning this source "
                             "does not know")
        return ranks

    def _flat_meta(self, name: str, p: torch.Tensor, first: tuple[str, tuple[int, ...]] | None
                   ) -> ParamMeta:
        if not is_partitioned(p):
            raise ValueError(f"{self._where()}: parameter {name!r} is not partitioned by "
                             f"ZeRO-3 (it has no ds_tensor) while the engine runs stage 3: "
                             "every parameter must be partitioned the same way")
        ranks = self._ranks(name, p)
        if first is not None and ranks != first[1]:
            raise ValueError(f"{self._where()}: parameter {name!r} is partitioned over ranks "
                             f"{list(ranks)}, {first[0]!r} over {list(first[1])}: every "
                             "parameter must be partitioned the same way")
        shape = tuple(int(x) for x in p.ds_shape)
        want = partition_numel(math.prod(shape), len(ranks))
        got = p.ds_tensor.numel()
        if got != want:
            raise ValueError(f"{self._where()}: parameter {name!r} of shape {shape} holds a "
                             f"partition of {got} elements, ZeRO-3's flat partitioning over "
                             f"{len(ranks)} ranks gives {want}: a partitioning this source "
                             "does not know")
        if swapped_out(p.ds_tensor):
            raise ValueError(f"{self._where()}: the partition of parameter {name!r} is not in "
                             "memory (swapped out to NVMe)")
        return ParamMeta(name=name, shape=shape, dtype=dtype_name(p.ds_tensor.dtype),
                         mesh=MeshDesc(ranks=ranks, shape=(len(ranks),)), placements=(FLAT,))

    def param_metas(self) -> list[ParamMeta]:
        """One :class:`ParamMeta` per parameter and persistent buffer (module docstring)."""
        everyone = MeshDesc(ranks=tuple(range(self.world)), shape=(self.world,))
        out: list[ParamMeta] = []
        first = None
        for name, t in self._entries():
            if isinstance(t, torch.nn.Parameter) and self.stage == 3:
                meta = self._flat_meta(name, t, first)
                first = first or (name, meta.mesh.ranks)
            elif is_partitioned(t):
                raise ValueError(f"{self._where()}: parameter {name!r} is ZeRO-3 partitioned "
                                 f"(it has a ds_tensor) but the engine runs ZeRO stage "
                                 f"{self.stage}: a partitioning this source does not know")
            else:  # ZeRO-0/1/2 parameters and buffers: whole on every rank
                meta = ParamMeta(name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype),
                                 mesh=everyone, placements=_REPLICATE)
            out.append(meta)
        self._check_names([m.name for m in out])
        return out

    def _check_names(self, names: list[str]) -> None:
        """Every parameter has a destination in the architecture's name table."""
        if getattr(self.module, "config", None) is None:
            return  # no architecture to check against: the planner's model config does
        from weight_transfer.model.models import model_config_from_hf

        try:
            cfg = model_config_from_hf(self.module, source=self._where())
        except ValueError as err:
            raise ValueError(f"{self._where()}: no name table maps parameter {names[0]!r}: "
                             f"{err}") from None
        missing = unmapped_trainer_names(cfg, expert_naming_of(self.module), names)
        if missing:
            raise ValueError(f"{self._where()}: parameter {missing[0]!r} has no destination in "
                             f"the {cfg.architecture} name table ({len(missing)} such "
                             f"parameters: {missing[:5]}); name it in the model's "
                             "ignore_params or leave it out of the attached model")

    # ------------------------------------------------------------------ bytes

    def tensors(self) -> dict[str, Any]:
        """What the executor reads each parameter from at this update: a
        :class:`FlatShard` over ``ds_tensor`` (ZeRO-3), else the full tensor."""
        out: dict[str, Any] = {}
        for name, t in self._entries():
            if self.stage == 3 and isinstance(t, torch.nn.Parameter):
                ranks = self._ranks(name, t)
                data = t.ds_tensor.data
                out[name] = FlatShard(data=data, shape=tuple(int(x) for x in t.ds_shape),
                                      start=ranks.index(self.rank) * data.numel(),
                                      group=getattr(t, "ds_process_group", None),
                                      world=len(ranks))
            else:
                out[name] = t.detach()
        return out

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole, by its Hugging Face name (a collective over
        the partition group for ZeRO-3: every rank calls)."""
        return {name: (t.full_tensor() if isinstance(t, FlatShard) else t).clone()
                for name, t in self.tensors().items()}
