"""The ready-made trainer's model: a transformers model sharded with FSDP2, and its steps.

Every rank builds the same seeded model, then shards it with ``fully_shard``
(each decoder layer, then the root) over the cluster's ``dense_mesh()``, a CPU
gloo mesh of all trainer ranks: 1-D ``(dp_shard,)`` (FSDP, placements
``(Shard(0),)``) or, with ``trainer.replicate`` > 1, 2-D ``(dp_replicate,
dp_shard)``, which ``fully_shard`` takes as HSDP (placements ``(Replicate(),
Shard(0))``: sharded inside each replica group, replicated across them; FSDP2
all-reduces gradients over the groups)::

    model = build_sharded_model(cfg, cluster, seed=0)        # inside a gloo group
    opt = make_optimizer(model, lr=1e-3)
    loss = train_step(model, opt, tokens, rank=r, world=4)  # a real optimizer step
    full = gather_full_state(model)                          # collective: all ranks call

MoE experts are stacked 3-D parameters in transformers 5
(``mlp.experts.gate_up_proj`` ``[E, 2*I, H]``). They are stored as the
cluster's ``stacked_expert_mesh()`` says: DTensors on the 2-D
``(ep, dp_shard_in_ep)`` mesh with placements ``(Shard(0), Shard(1))``, so EP
mesh ``k`` holds experts of EP rank ``k``, sharded FSDP-style inside it
(:class:`StackedExperts`, outside FSDP's own management). The forward gathers
them (like FSDP's all-gather) and gradients are reduce-scattered back with an
average; there is no all-to-all token dispatch, so this is EP-sharded storage
with data-parallel compute. The plan then has two mesh groups (dense, experts).

:func:`train_step` minimizes the (optionally advantage-weighted) negative
log-likelihood of the tokens after ``prompt_len``: with ``advantages=None``
it is next-token training, with per-sequence advantages it is REINFORCE.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from scheduling.cluster.config import ClusterConfig
from weight_transfer.model.models import ModelConfig
from weight_transfer.types import MeshDesc

log = logging.getLogger(__name__)

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class StackedExperts(nn.Module):
    """A transformers stacked-experts module whose weights are 2-D (EP x FSDP) DTensors.

    The wrapped module keeps its forward; its parameters move here (same
    names, so state-dict keys do not change) and are gathered per forward.
    """

    def __init__(self, inner: nn.Module, mesh: DeviceMesh, placements: tuple) -> None:
        super().__init__()
        for name in EXPERT_PARAMS:
            full = getattr(inner, name).detach()
            del inner._parameters[name]
            self.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, placements)))
        object.__setattr__(self, "_inner", inner)  # not a submodule: its weights are ours

    def forward(self, *args, **kwargs):
        for name in EXPERT_PARAMS:
            param = getattr(self, name)
            replicated = [Replicate()] * param.device_mesh.ndim
            # Backward: the average over ranks of each rank's gradient, reduce-scattered.
            averaged = [Partial("avg")] * param.device_mesh.ndim
            full = param.redistribute(placements=replicated).to_local(grad_placements=averaged)
            setattr(self._inner, name, full)
        try:
            return self._inner(*args, **kwargs)
        finally:
            for name in EXPERT_PARAMS:
                delattr(self._inner, name)


def _device_mesh(desc: MeshDesc) -> DeviceMesh:
    grid = torch.tensor(desc.ranks, dtype=torch.int64).reshape(desc.shape)
    return DeviceMesh("cpu", grid, mesh_dim_names=desc.dim_names)


def _expert_mesh(cluster: ClusterConfig) -> tuple[DeviceMesh, tuple]:
    desc, placements = cluster.stacked_expert_mesh()
    return _device_mesh(desc), tuple(Shard(p.dim) for p in placements)


def dense_device_mesh(cluster: ClusterConfig) -> DeviceMesh:
    """The FSDP2 mesh of dense parameters, ``cluster.dense_mesh()``: on a 2-D mesh
    ``fully_shard`` places them as ``cluster.dense_placements()`` says (HSDP)."""
    return _device_mesh(cluster.dense_mesh())


def build_sharded_model(cfg: ModelConfig, cluster: ClusterConfig, *, seed: int) -> nn.Module:
    """The seeded transformers model sharded over the cluster's trainer meshes (gloo, CPU)."""
    from weight_transfer.engines.reference.hf_model import (
        build_hf_model,  # transformers: only this builder needs it
    )

    model = build_hf_model(cfg, seed=seed)
    mesh = dense_device_mesh(cluster)
    experts: set[nn.Parameter] = set()
    expert_mesh = None
    for layer in model.model.layers:
        inner = getattr(layer.mlp, "experts", None)
        if inner is not None and all(isinstance(getattr(inner, n, None), nn.Parameter)
                                     for n in EXPERT_PARAMS):
            if expert_mesh is None:
                expert_mesh = _expert_mesh(cluster)
            layer.mlp.experts = StackedExperts(inner, *expert_mesh)
            experts.update(layer.mlp.experts.parameters())
        fully_shard(layer, mesh=mesh, ignored_params=experts or None)
    fully_shard(model, mesh=mesh, ignored_params=experts or None)
    return model


def make_optimizer(model: nn.Module, *, lr: float) -> torch.optim.Optimizer:
    # foreach kernels would mix DTensors of two meshes (dense and experts) in one call.
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)


def _as_batch(tokens: Sequence[Sequence[int]] | torch.Tensor, vocab: int) -> torch.Tensor:
    ids = torch.as_tensor(tokens, dtype=torch.long)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"tokens must be [batch, length >= 2], got shape {tuple(ids.shape)}")
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"tokens must lie in [0, {vocab}); got [{ids.min()}, {ids.max()}]")
    return ids


def rank_rows(batch: int, *, rank: int, world: int) -> slice:
    """Rows of a batch this rank trains on: an equal share if the batch divides, else all."""
    if batch % world == 0 and batch >= world:
        per = batch // world
        return slice(rank * per, (rank + 1) * per)
    return slice(0, batch)


def sequence_loss(
    logits: torch.Tensor, ids: torch.Tensor, *, prompt_len: int, weights: torch.Tensor | None
) -> torch.Tensor:
    """Mean over sequences of ``weight * mean NLL`` of tokens after ``prompt_len``."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    tok_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    mask = torch.zeros_like(tok_logp)
    mask[:, max(prompt_len - 1, 0) :] = 1.0
    per_seq = -(tok_logp * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    if weights is not None:
        per_seq = per_seq * weights
    return per_seq.mean()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: Sequence[Sequence[int]] | torch.Tensor,
    *,
    rank: int,
    world: int,
    advantages: Sequence[float] | None = None,
    prompt_len: int = 0,
) -> float:
    """One optimizer step on this rank's share of ``tokens``; returns the mean loss over ranks."""
    ids = _as_batch(tokens, model.config.vocab_size)
    weights = None
    if advantages is not None:
        weights = torch.as_tensor(advantages, dtype=torch.float32)
        if weights.shape != (ids.shape[0],):
            raise ValueError(
                f"advantages must have one value per sequence ({ids.shape[0]}), "
                f"got shape {tuple(weights.shape)}"
            )
    if not 0 <= prompt_len < ids.shape[1]:
        raise ValueError(f"prompt_len {prompt_len} outside [0, {ids.shape[1]})")
    rows = rank_rows(ids.shape[0], rank=rank, world=world)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=ids[rows], use_cache=False).logits
    w = weights[rows] if weights is not None else None
    loss = sequence_loss(logits, ids[rows], prompt_len=prompt_len, weights=w)
    loss.backward()
    optimizer.step()
    model.eval()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return float(mean) / world


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full plain tensor (a collective: every rank calls)."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().clone()
    return out
