"""Metadata of live models: trainer parameters as :class:`ParamMeta`, engine tensors as specs.

Trainer side, on every trainer rank (FSDP2 parameters are DTensors)::

    metas = param_metas_from_module(model)   # name, global shape, dtype, mesh, placements

A DTensor's mesh becomes a :class:`MeshDesc` of global ranks (``rank_of_mesh``
maps the mesh's process-group ranks when they are numbered differently from the
transfer's trainer ranks); a plain tensor (a non-sharded buffer such as
DeepSeek's ``e_score_correction_bias``) is replicated on ``replicated_ranks``
(default: every rank of the default process group). Names are canonical
(wrapper prefixes stripped) and tied aliases are listed once.

Engine side, from the engine's state dict::

    specs = engine_tensors_from_state(dict(engine_model.named_parameters()))

Expert naming of a live model, from its parameter names alone (no transformers)::

    expert_naming_of(model)   # "stacked" (transformers-5 3-D experts) or "per_expert"
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from weight_transfer.model.naming import canonical_trainer_name
from weight_transfer.types import MeshDesc, ParamMeta, Placement, TensorSpec

log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names :data:`DTYPE_SIZES` uses)."""
    return str(dtype).removeprefix("torch.")


def _placement(p) -> Placement:
    if p.is_shard():
        return Placement(kind="shard", dim=p.dim)
    if p.is_replicate():
        return Placement(kind="replicate")
    if p.is_partial():
        return Placement(kind="partial")
    raise ValueError(f"unsupported DTensor placement {p!r}")


def _default_ranks() -> tuple[int, ...]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return tuple(range(dist.get_world_size()))
    return (0,)


def _alias_key(t: torch.Tensor) -> tuple:
    """Two entries with this key are the same memory (a tied weight under two names)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.device.type == "meta" or local.numel() == 0:
        return ("object", id(t))  # no memory to compare: only the same object is an alias
    return (
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(t.shape),
        tuple(local.stride()),
        t.dtype,
    )


def param_metas_from_module(
    module: torch.nn.Module,
    *,
    rank_of_mesh: Callable[[int], int] | None = None,
    replicated_ranks: Sequence[int] | None = None,
) -> list[ParamMeta]:
    """Every parameter and persistent buffer of ``module`` (its ``state_dict``) as metadata."""
    from torch.distributed.tensor import DTensor

    to_rank = rank_of_mesh or (lambda r: r)
    ranks = tuple(replicated_ranks) if replicated_ranks is not None else _default_ranks()
    plain_mesh = MeshDesc(ranks=ranks, shape=(len(ranks),))
    seen: set[tuple] = set()
    out: list[ParamMeta] = []
    for raw_name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        key = _alias_key(t)
        if key in seen:
            log.debug("skipping %s: alias of an earlier tensor (tied weight)", raw_name)
            continue
        seen.add(key)
        if isinstance(t, DTensor):
            grid = t.device_mesh.mesh
            mesh = MeshDesc(
                ranks=tuple(to_rank(int(r)) for r in grid.flatten().tolist()),
                shape=tuple(grid.shape),
                dim_names=tuple(t.device_mesh.mesh_dim_names or ()),
            )
            placements = tuple(_placement(p) for p in t.placements)
        else:
            mesh, placements = plain_mesh, (Placement(kind="replicate"),)
        out.append(
            ParamMeta(
                name=canonical_trainer_name(raw_name),
                shape=tuple(t.shape),
                dtype=dtype_name(t.dtype),
                mesh=mesh,
                placements=placements,
            )
        )
    return out


def engine_tensors_from_state(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """Name, local shape and dtype of each engine tensor, in ``state`` order.

    A name whose tensor aliases an earlier entry's memory exactly (vLLM's tied
    ``lm_head`` and ``embed_tokens``) is listed once, under the first name.
    """
    seen: set[tuple] = set()
    out = []
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"engine state entry {name!r} is a {type(t).__name__}, not a tensor")
        key = _alias_key(t)
        if key in seen:
            continue
        seen.add(key)
        out.append(TensorSpec(name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype)))
    return out


# A transformers-5 MoE model holds each layer's experts as one 3-D parameter.
_STACKED_EXPERTS_SUFFIX = "mlp.experts.gate_up_proj"


def expert_naming_of(model: torch.nn.Module) -> str:
    """``"stacked"`` if the model holds 3-D expert parameters (transformers 5), else
    ``"per_expert"`` (also for dense models, whose names are the same either way).

    Decided from parameter names alone, so a trainer actor needs no transformers
    import to report its naming (``TrainerMixin.wt_param_metas``).
    """
    stacked = any(n.endswith(_STACKED_EXPERTS_SUFFIX) for n, _ in model.named_parameters())
    return "stacked" if stacked else "per_expert"
