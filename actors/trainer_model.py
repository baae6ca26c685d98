"""The ready-made trainer's model: a transformers model sharded with FSDP2, and its steps.

Every rank builds the same seeded model, then shards it with ``fully_shard``
over a CPU gloo mesh of all trainer ranks (each decoder layer, then the root)::

    model = build_sharded_model(cfg, seed=0, world=4)        # inside a gloo group
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = train_step(model, opt, tokens, rank=r, world=4)  # a real optimizer step
    full = gather_full_state(model)                          # collective: all ranks call

MoE experts are stacked 3-D parameters in transformers 5; they are sharded
over all ranks along the expert dimension like the dense parameters (one
mesh, so one mesh group in the plan). True expert parallelism on the cluster's
EP meshes would need an all-to-all token dispatch inside the model's forward,
which the transformers modules do not have.

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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from weight_transfer.engines.hf_model import build_hf_model
from weight_transfer.models import ModelConfig

log = logging.getLogger(__name__)


def build_sharded_model(cfg: ModelConfig, *, seed: int, world: int) -> nn.Module:
    """The seeded transformers model, FSDP2-sharded over ranks ``0..world-1`` (gloo, CPU)."""
    model = build_hf_model(cfg, seed=seed)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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
