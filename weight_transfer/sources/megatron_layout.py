"""A Megatron trainer rank's parameters as Hugging Face parameters for the plan (pure, no torch).

:mod:`weight_transfer.sources.megatron` reads plain data off the live model - per
parameter a :class:`LocalParam` (name, local shape, dtype, Megatron's
``tensor_model_parallel`` and ``partition_dim``), the model's :class:`MegatronDims`
and the rank's TP and DP groups - and this module turns each Megatron parameter into
the Hugging Face parameters it holds (:mod:`weight_transfer.model.arch.megatron_gpt`),
each an :class:`HfPart`:

* its :class:`~weight_transfer.types.ParamMeta`: the Hugging Face name (global layer
  index; an MoE expert's global expert index), the global shape (the part's rows of the
  local shard times TP on the cut dim; the vocabulary as padded), on the stage's
  ``(dp, tp)`` mesh (:func:`stage_mesh`) as ``(Replicate(), Shard(partition_dim))``, or
  ``(Replicate(), Replicate())`` for what every TP rank holds whole; an expert's on the
  expert mesh (its expert data-parallel x expert-TP ranks, the same grid), cut over
  expert TP;
* the :class:`~weight_transfer.model.arch.megatron_gpt.Bands` of the local shard it is
  (a grouped QKV shard's q, k or v rows; a ``linear_fc1`` shard's gate or up half).

Since a rank's part is exactly the ``Shard`` block the placement gives it, the
shard-direct planner writes each rank's own bytes where its block covers an engine
rank's, and gathers over the TP group only where it does not. Refused with a
ValueError naming the parameter, the rank and what is missing: a name no table maps, a
TP-cut parameter without ``partition_dim`` (or with another than the table's) when
TP > 1, a shard whose rows do not split into the fused parts, two parameters of one
Hugging Face name::

    mesh = stage_mesh(rank, tp_ranks, dp_ranks)
    parts = describe(params, dims=dims, mesh=mesh, global_layer={0: 2, 1: 3}, where="...")
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from weight_transfer.model.arch.megatron_gpt import Bands, Fusion, map_megatron_name, part_bands
from weight_transfer.model.arch.megatron_moe import map_expert_name
from weight_transfer.types import MeshDesc, ParamMeta, Placement

__all__ = ["HfPart", "LocalParam", "MegatronDims", "describe", "stage_mesh", "unique_names"]

_REPLICATE = Placement(kind="replicate")
TIED_OUTPUT = "output_layer.weight"  # the last stage's copy of tied embeddings


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalParam:
    """One Megatron parameter as a rank holds it; ``tensor_parallel`` and ``partition_dim``
    are Megatron's attributes of it (None: absent)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    tensor_parallel: bool | None = None
    partition_dim: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronDims:
    """What of the model's config decides the parts: the TP size, attention heads and
    query groups, whether the output layer is the embedding's (tied), and of MoE layers
    the expert TP size, the experts each EP rank holds and this rank's first (the model's
    index of its local expert 0)."""

    tp: int
    heads: int
    query_groups: int
    tied: bool = False
    etp: int = 1
    experts_per_rank: int = 0
    first_expert: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class HfPart:
    """One Hugging Face parameter of a Megatron parameter (``source``): its metadata, its
    rows of the local shard, the tensor dim TP cuts (None: whole on every TP rank), and
    whether it is an MoE expert's (then cut over expert TP, not TP)."""

    meta: ParamMeta
    source: str
    bands: Bands
    dim: int | None
    expert: bool = False


def stage_mesh(rank: int, tp_ranks: Sequence[int], dp_ranks: Sequence[int]) -> MeshDesc:
    """The ``(dp, tp)`` mesh of the ranks holding this rank's pipeline stage, from its own
    TP group and DP group (global ranks, in group order): Megatron lays its groups out
    as strides of one rank grid, so DP replica ``d``'s TP rank ``t`` is
    ``dp_ranks[d] + tp_ranks[t] - rank``. ValueError if the groups do not hold the rank."""
    if rank not in tp_ranks or rank not in dp_ranks:
        raise ValueError(f"trainer rank {rank} is not in its own TP group {list(tp_ranks)} "
                         f"and DP group {list(dp_ranks)}")
    grid = tuple(d + t - rank for d in dp_ranks for t in tp_ranks)
    if min(grid) < 0 or len(set(grid)) != len(grid):
        raise ValueError(f"trainer rank {rank}: TP group {list(tp_ranks)} and DP group "
                         f"{list(dp_ranks)} do not form a rank grid (a layout of groups "
                         "this source does not know)")
    return MeshDesc(ranks=grid, shape=(len(dp_ranks), len(tp_ranks)), dim_names=("dp", "tp"))


def describe(params: Iterable[LocalParam], *, dims: MegatronDims, mesh: MeshDesc,
             global_layer: Mapping[int, int], where: str,
             expert_mesh: MeshDesc | None = None) -> list[HfPart]:
    """Every Hugging Face part of ``params`` (module docstring), in their order;
    ``expert_mesh``: the mesh of this rank's MoE experts (needed if it holds any)."""
    out = [part for p in params
           for part in _parts(p, dims=dims, mesh=mesh, global_layer=global_layer, where=where,
                              expert_mesh=expert_mesh)]
    unique_names([(part.meta.name, part.source) for part in out], where)
    return out


def unique_names(names: Iterable[tuple[str, str]], where: str) -> None:
    """ValueError if two Megatron parameters hold one Hugging Face parameter
    (``names``: (Hugging Face name, Megatron name) pairs)."""
    seen: dict[str, str] = {}
    for name, source in names:
        if name in seen:
            raise ValueError(f"{where}: parameters {seen[name]!r} and {source!r} both hold "
                             f"Hugging Face parameter {name!r}")
        seen[name] = source


def _parts(p: LocalParam, *, dims: MegatronDims, mesh: MeshDesc,
           global_layer: Mapping[int, int], where: str,
           expert_mesh: MeshDesc | None) -> list[HfPart]:
    if dims.tied and p.name == TIED_OUTPUT:
        return []  # the engine's lm_head is its embedding
    found = map_megatron_name(p.name, global_layer) or map_expert_name(
        p.name, global_layer, first_expert=dims.first_expert,
        experts_per_rank=dims.experts_per_rank)
    if found is None:
        raise ValueError(f"{where}: parameter {p.name!r} has no destination: no Megatron name "
                         "table maps it (the dense GPT layers of "
                         "weight_transfer.model.arch.megatron_gpt, the MoE layers of "
                         "weight_transfer.model.arch.megatron_moe with "
                         f"{dims.experts_per_rank} experts per EP rank)")
    rule, names = found
    if rule.expert:
        if expert_mesh is None:
            raise ValueError(f"{where}: parameter {p.name!r} is an MoE expert's, and the "
                             "expert mesh (expert data-parallel and expert-TP groups) is "
                             "missing")
        mesh = expert_mesh
    dim = _cut_dim(p, rule.partition_dim, dims.etp if rule.expert else dims.tp, where)
    groups = _local_groups(dims, where) if rule.fusion == Fusion.QKV else 1
    placements = (_REPLICATE, _REPLICATE if dim is None else Placement(kind="shard", dim=dim))
    out = []
    for i, name in enumerate(names):
        try:
            bands = part_bands(rule.fusion, i, rows=p.shape[0], groups=groups,
                               q_per_group=dims.heads // dims.query_groups)
        except ValueError as err:
            raise ValueError(f"{where}: parameter {p.name!r} of local shape {p.shape}: "
                             f"{err}") from None
        tp = dims.etp if rule.expert else dims.tp
        local = (bands.rows, *p.shape[1:])
        glob = local if dim is None else tuple(
            n * tp if d == dim else n for d, n in enumerate(local))
        meta = ParamMeta(name=name, shape=glob, dtype=p.dtype, mesh=mesh,
                         placements=placements)
        out.append(HfPart(meta=meta, source=p.name, bands=bands, dim=dim, expert=rule.expert))
    return out


def _cut_dim(p: LocalParam, want: int | None, tp: int, where: str) -> int | None:
    """The dim TP cuts ``p`` on (the table's), checked against Megatron's attributes."""
    if tp == 1:
        return want  # one TP rank: the attributes, if any, cut nothing
    cut = bool(p.tensor_parallel)
    if want is not None and (not cut or p.partition_dim is None):
        raise ValueError(f"{where}: parameter {p.name!r} has no partition_dim (Megatron's "
                         f"tensor_model_parallel attributes) while TP is {tp}: which dim "
                         f"its shard cuts is missing (the name table says {want})")
    if want is not None and p.partition_dim != want:
        raise ValueError(f"{where}: parameter {p.name!r} has partition_dim "
                         f"{p.partition_dim}, the Megatron name table says {want}")
    if want is None and cut:
        raise ValueError(f"{where}: parameter {p.name!r} is cut over TP (partition_dim "
                         f"{p.partition_dim}), the Megatron name table says every TP rank "
                         "holds it whole")
    return want


def _local_groups(dims: MegatronDims, where: str) -> int:
    if dims.heads % dims.query_groups or dims.query_groups % dims.tp:
        raise ValueError(f"{where}: {dims.heads} attention heads in {dims.query_groups} query "
                         f"groups over TP {dims.tp}: the groups must divide the heads and TP "
                         "the groups")
    return dims.query_groups // dims.tp
