"""The Megatron-core source: a trainer rank of a Megatron ``GPTModel`` describes its weights live.

Attach the model (a ``GPTModel``, the wrappers around it that keep it in ``.module``
- Megatron's ``DistributedDataParallel``, ``Float16Module`` - or the list of its
virtual pipeline chunks); nothing of megatron is imported. The source reads the
model's ``config`` (a ``TransformerConfig``: TP size, heads, query groups), its
``pg_collection`` (the TP group and the DP group, with context parallelism where it
has one), each decoder layer's ``layer_number`` (global under pipeline parallelism)
and each parameter's ``tensor_model_parallel`` and ``partition_dim``.

Each Megatron parameter becomes the Hugging Face parameters it holds
(:mod:`weight_transfer.sources.megatron_layout`): under their Hugging Face names with
global layer indexes, cut over the TP group as ``Shard(partition_dim)`` on the
stage's ``(dp, tp)`` mesh (replicated over DP), so the plan writes every rank's own
shard where it covers an engine rank's bytes and gathers over the TP group only
elsewhere; pipeline stages are disjoint meshes that write at the same time. MoE
layers (Qwen3-MoE's: a router, local experts; :mod:`weight_transfer.model.arch.megatron_moe`)
put each expert under the model's expert index (its EP rank's first plus its local
one), on the expert mesh (the ``expt_dp`` x ``expt_tp`` groups of ``pg_collection``),
cut over expert TP: EP ranks hold disjoint experts and write them at once. At an
update each is read from the live parameter as a :class:`TpBlock`: its rows of the
rank's Megatron shard (a grouped QKV shard's q, k or v heads; a ``linear_fc1`` shard's
gate or up half), a view of the shard, or a copy when a QKV shard holds several query
groups (their q rows are not one band; the prepare stage copies them once more, into
staging)::

    source = MegatronSource(model, rank=r, world=n)
    source.param_metas()   # Hugging Face names, (Replicate(), Shard(d)) on the (dp, tp) mesh
    source.tensors()       # {Hugging Face name: TpBlock over the Megatron shard, or a tensor}

The vocabulary stays padded as Megatron holds it (the plan reads only the rows of the
Hugging Face ``vocab_size``). The names are Hugging Face's; the architecture and its
sizes come from the transfer's model file (``TransferConfig.model``): a Megatron model
has no Hugging Face ``.config``. With tied embeddings the last stage's copy of the
embedding (``output_layer.weight``) is not sent. Refused when attached (ValueError
naming the parameter, the rank and what is missing; nothing is registered or written):
a parameter no name table maps (shared experts, learned position embeddings), a TP-cut
parameter without ``partition_dim`` when TP > 1, fused rows that do not split into
their parts, TP and DP groups that are not Megatron's rank grid, experts that do
not divide over the EP group, and a
``torch.distributed`` rank other than the one attached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from weight_transfer.model.arch.megatron_gpt import Bands
from weight_transfer.model.live_metadata import dtype_name
from weight_transfer.sender.flat_shard import OverData
from weight_transfer.sources.megatron_layout import (
    HfPart,
    LocalParam,
    MegatronDims,
    describe,
    stage_mesh,
    unique_names,
)
from weight_transfer.types import ParamMeta

__all__ = ["MegatronSource", "TpBlock", "cut_bands", "model_chunks"]


def cut_bands(shard: torch.Tensor, bands: Bands) -> torch.Tensor:
    """The rows ``bands`` of a Megatron shard: a view when they are one band, else a copy."""
    if bands.groups == 1:
        return shard.narrow(0, bands.start * bands.unit, bands.count * bands.unit)
    lo = bands.start * bands.unit
    grouped = shard.view(bands.groups, bands.period * bands.unit, *shard.shape[1:])
    return grouped[:, lo : lo + bands.count * bands.unit].reshape(bands.rows, *shard.shape[1:])


@dataclass(frozen=True, slots=True, kw_only=True)
class TpBlock(OverData):
    """A rank's block of one Hugging Face parameter: ``bands`` of its Megatron shard
    ``data``; ``shape`` is the parameter's global shape, ``dim`` the tensor dim TP cuts
    (None: whole on every TP rank), ``group`` the TP group (a process group) of
    ``world`` ranks."""

    data: torch.Tensor
    bands: Bands
    shape: tuple[int, ...]
    dim: int | None
    group: Any
    world: int

    def to_local(self) -> torch.Tensor:
        """The rank's block (the rows of the Hugging Face parameter it holds)."""
        return cut_bands(self.data, self.bands)

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter: an ``all_gather`` over the TP group (a collective)."""
        local = self.to_local().contiguous()
        if self.dim is None or self.world == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)]
        torch.distributed.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=self.dim)


def is_gpt_model(obj: Any) -> bool:
    """A Megatron ``GPTModel`` (duck-typed: a module with a TransformerConfig-like config
    and a decoder or an embedding)."""
    cfg = getattr(obj, "config", None)
    return (isinstance(obj, torch.nn.Module) and hasattr(cfg, "tensor_model_parallel_size")
            and hasattr(cfg, "num_query_groups")
            and (hasattr(obj, "decoder") or hasattr(obj, "embedding")))


def model_chunks(model: Any) -> list[Any]:
    """The GPTModels of ``model`` (a list of virtual pipeline chunks, or one), each taken
    out of the wrappers that keep it in ``.module`` (DDP, Float16Module)."""
    out = []
    for m in model if isinstance(model, list | tuple) else [model]:
        while not is_gpt_model(m) and isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        out.append(m)
    return out


def _group_ranks(group: Any) -> tuple[int, ...]:
    dist = torch.distributed
    ranks = dist.get_process_group_ranks(group)
    return tuple(sorted(ranks, key=lambda g: dist.get_group_rank(group, g)))


def _global_layers(chunk: Any) -> dict[int, int]:
    """The chunk's decoder layer index -> the model's (``layer_number`` counts from 1)."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", ())
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


class MegatronSource:
    """See the module docstring."""

    name = "megatron"

    def __init__(self, model: Any, *, rank: int, world: int) -> None:
        self.chunks = model_chunks(model)
        if not self.chunks or not all(map(is_gpt_model, self.chunks)):
            raise ValueError(f"trainer rank {rank}: the megatron source takes a Megatron "
                             "GPTModel (or a wrapper keeping it in .module, or the list of its "
                             f"virtual pipeline chunks), not {type(model).__name__}")
        self.rank, self.world, self.module = rank, world, self.chunks[0]
        cfg = self.module.config
        self.dims = MegatronDims(
            tp=int(cfg.tensor_model_parallel_size), heads=int(cfg.num_attention_heads),
            query_groups=int(cfg.num_query_groups or cfg.num_attention_heads),
            tied=bool(getattr(self.module, "share_embeddings_and_output_weights", False)))
        self.tp_group, tp_ranks, dp_ranks = self._groups()
        if len(tp_ranks) != self.dims.tp:
            raise ValueError(f"{self._where()}: its TP group holds ranks {list(tp_ranks)}, the "
                             f"model's config says tensor_model_parallel_size {self.dims.tp}")
        self.mesh = stage_mesh(rank, tp_ranks, dp_ranks)
        self.etp_group, self.expert_mesh = self.tp_group, None
        if getattr(cfg, "num_moe_experts", None):
            self._experts(int(cfg.num_moe_experts))
        self._parts: list[tuple[HfPart, torch.Tensor]] | None = None

    @classmethod
    def recognizes(cls, model: Any) -> bool:
        chunks = model_chunks(model)
        return bool(chunks) and all(map(is_gpt_model, chunks))

    def _where(self) -> str:
        return f"trainer rank {self.rank} (megatron source)"

    def _groups(self) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
        """(the TP group, its ranks, the DP group's ranks), global ranks in group order."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            if self.dims.tp != 1 or self.world != 1:
                raise ValueError(f"{self._where()}: torch.distributed is not initialized, so "
                                 f"the TP group of a model of TP {self.dims.tp} on {self.world} "
                                 "trainer ranks is unknown")
            return None, (self.rank,), (self.rank,)
        got = (dist.get_rank(), dist.get_world_size())
        if got != (self.rank, self.world):
            raise ValueError(f"{self._where()}: torch.distributed says rank {got[0]} of "
                             f"{got[1]}, wt_attach was given rank {self.rank} of {self.world}; "
                             "Megatron's groups are named by global ranks, so the two must "
                             "agree")
        pgs = getattr(self.module, "pg_collection", None)
        tp = getattr(pgs, "tp", None)
        dp = getattr(pgs, "dp_cp", None) or getattr(pgs, "dp", None)
        if tp is None or dp is None:
            raise ValueError(f"{self._where()}: the model has no pg_collection with its tp and "
                             "dp groups (every megatron-core 0.14+ GPTModel keeps one)")
        return tp, _group_ranks(tp), _group_ranks(dp)

    def _experts(self, experts: int) -> None:
        """The MoE layers' groups: expert TP, expert data parallel (the expert mesh) and EP
        (which of the model's experts this rank holds)."""
        pgs = getattr(self.module, "pg_collection", None)
        groups = {f: getattr(pgs, f, None) for f in ("ep", "expt_tp", "expt_dp")}
        if not torch.distributed.is_initialized():
            ep_ranks = etp_ranks = edp_ranks = (self.rank,)
        elif None in groups.values():
            missing = [f for f, g in groups.items() if g is None]
            raise ValueError(f"{self._where()}: the model has MoE layers and its "
                             f"pg_collection lacks the groups {missing}")
        else:
            self.etp_group = groups["expt_tp"]
            ep_ranks, etp_ranks, edp_ranks = (_group_ranks(groups[f])
                                              for f in ("ep", "expt_tp", "expt_dp"))
        if experts % len(ep_ranks):
            raise ValueError(f"{self._where()}: {experts} experts do not divide over its EP "
                             f"group of {len(ep_ranks)} ranks {list(ep_ranks)}")
        per_rank = experts // len(ep_ranks)
        self.dims = replace(self.dims, etp=len(etp_ranks), experts_per_rank=per_rank,
                            first_expert=ep_ranks.index(self.rank) * per_rank)
        self.expert_mesh = stage_mesh(self.rank, etp_ranks, edp_ranks)

    def check(self) -> None:
        """Every refusal of the module docstring, before anything is set up."""
        self._described()

    def _described(self) -> list[tuple[HfPart, torch.Tensor]]:
        if self._parts is None:
            out: list[tuple[HfPart, torch.Tensor]] = []
            for chunk in self.chunks:
                live = dict(chunk.named_parameters())
                params = [LocalParam(name=n, shape=tuple(p.shape), dtype=dtype_name(p.dtype),
                                     tensor_parallel=getattr(p, "tensor_model_parallel", None),
                                     partition_dim=getattr(p, "partition_dim", None))
                          for n, p in live.items()]
                parts = describe(params, dims=self.dims, mesh=self.mesh,
                                 global_layer=_global_layers(chunk), where=self._where(),
                                 expert_mesh=self.expert_mesh)
                out += [(part, live[part.source]) for part in parts]
            unique_names([(part.meta.name, part.source) for part, _ in out], self._where())
            self._parts = out
        return self._parts

    def param_metas(self) -> list[ParamMeta]:
        """One :class:`ParamMeta` per Hugging Face parameter (module docstring)."""
        return [part.meta for part, _ in self._described()]

    def tensors(self) -> dict[str, Any]:
        """What the executor reads each parameter from at this update: a :class:`TpBlock`
        over the live Megatron shard, or the tensor itself where it is whole everywhere."""
        out: dict[str, Any] = {}
        for part, p in self._described():
            b = part.bands
            group, tp = ((self.etp_group, self.dims.etp) if part.expert
                         else (self.tp_group, self.dims.tp))
            whole = b.groups == 1 and b.period == 1 and (part.dim is None or tp == 1)
            out[part.meta.name] = p.detach() if whole else TpBlock(
                data=p.detach(), bands=b, shape=part.meta.shape, dim=part.dim,
                group=group, world=tp)
        return out

    def full_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters whole, by Hugging Face name, the vocabulary padded (a
        collective over the TP group: every rank of the stage calls)."""
        return {name: (t.full_tensor() if isinstance(t, TpBlock) else t).clone()
                for name, t in self.tensors().items()}
