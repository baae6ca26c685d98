"""The layers of the reference engine, each a function of one TP/EP shard's fused weights.

A layer reads its weights through ``w(name) -> float32 tensor`` (the engine
upcasts bf16 or dequantizes FP8 on every use, so a weight update between two
steps is seen by the next one) and talks to the other TP ranks through a
:class:`~weight_transfer.engines.reference.ops.TensorParallel`. The cuts are vLLM's:

* vocab-parallel embedding and head: rank r holds rows ``[r*P, r*P + n)`` of the
  vocabulary padded to a multiple of 64 (``P = padded / tp``);
* column-parallel ``qkv_proj`` (this rank's q heads, then its k and v heads; KV
  heads are replicated when tp > kv_heads) and ``gate_up_proj`` (gate rows, then
  up rows); row-parallel ``o_proj`` / ``down_proj`` followed by an all-reduce;
* MoE: a replicated router, the local experts' ``w13`` ([E_local, 2*I_local, H],
  gate then up) and ``w2`` ([E_local, H, I_local]); with ep_size 1 every expert
  is TP-sharded on I, with ep_size > 1 each rank holds whole experts. Either
  way each rank's output is a partial sum, all-reduced over the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from weight_transfer.engines.reference.ops import (
    TensorParallel,
    apply_rope,
    causal_attention,
    rms_norm,
)
from weight_transfer.layout.shard_geometry import VOCAB_PADDING
from weight_transfer.model.models import ModelConfig
from weight_transfer.types import ShardSpec

Weights = Callable[[str], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    """Per-rank sizes: local q/kv heads, vocabulary rows, local experts."""

    heads: int
    kv_heads: int
    head_dim: int
    vocab_start: int
    vocab_per_rank: int
    experts: range
    top_k: int
    norm_topk: bool
    eps: float


def geometry(cfg: ModelConfig, shard: ShardSpec, eps: float) -> Geometry:
    tp = shard.tp_size
    if cfg.num_attention_heads % tp:
        raise ValueError(f"{cfg.num_attention_heads} attention heads do not split over tp={tp}")
    padded = -(-cfg.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    n_exp, ep = cfg.n_experts, shard.ep_size
    if ep > 1 and (ep != tp or n_exp % ep):
        raise ValueError(
            f"expert parallelism needs ep_size == tp_size dividing {n_exp} experts; "
            f"got ep_size={ep}, tp_size={tp}"
        )
    if n_exp and not cfg.num_experts_per_tok:
        raise ValueError(f"{cfg.name or cfg.architecture}: num_experts_per_tok is required")
    per_ep = n_exp // ep
    return Geometry(
        heads=cfg.num_attention_heads // tp,
        kv_heads=max(1, cfg.kv_heads // tp),
        head_dim=cfg.head_size,
        vocab_start=shard.tp_rank * (padded // tp),
        vocab_per_rank=padded // tp,
        experts=range(shard.ep_rank * per_ep, (shard.ep_rank + 1) * per_ep),
        top_k=cfg.num_experts_per_tok or 0,
        norm_topk=cfg.arch.norm_topk(cfg),
        eps=eps,
    )


def embed(ids: torch.Tensor, table: torch.Tensor | None, geo: Geometry,
          tp: TensorParallel, hidden: int) -> torch.Tensor:
    """Vocab-parallel lookup: this rank's rows, zeros elsewhere, summed over ranks."""
    out = torch.zeros(*ids.shape, hidden, dtype=torch.float32)
    if table is not None:
        local = ids - geo.vocab_start
        mask = (local >= 0) & (local < table.shape[0])
        out = F.embedding(local.clamp(0, table.shape[0] - 1), table) * mask[..., None]
    return tp.all_reduce(out)


def lm_head(h: torch.Tensor, table: torch.Tensor | None, geo: Geometry,
            tp: TensorParallel, vocab: int) -> torch.Tensor:
    """Vocab-parallel logits, gathered on every rank, padding rows cut."""
    local = h.new_zeros(*h.shape[:-1], 0) if table is None else h @ table.T
    return tp.all_gather_last(local, geo.vocab_per_rank)[..., :vocab]


def _linear(x: torch.Tensor, w: Weights, name: str, has: Callable[[str], bool]) -> torch.Tensor:
    y = x @ w(f"{name}.weight").T
    bias = f"{name}.bias"
    return y + w(bias) if has(bias) else y


def attention(x: torch.Tensor, w: Weights, has: Callable[[str], bool], p: str, geo: Geometry,
              tp: TensorParallel, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Self-attention of layer prefix ``p`` (``model.layers.i.self_attn``) on local heads."""
    b, t, _ = x.shape
    hd = geo.head_dim
    qkv = _linear(x, w, f"{p}.qkv_proj", has)
    q, k, v = qkv.split([geo.heads * hd, geo.kv_heads * hd, geo.kv_heads * hd], dim=-1)
    q, k, v = (z.reshape(b, t, -1, hd) for z in (q, k, v))
    if has(f"{p}.q_norm.weight"):  # qwen3: per-head RMSNorm before RoPE
        q = rms_norm(q, w(f"{p}.q_norm.weight"), geo.eps)
        k = rms_norm(k, w(f"{p}.k_norm.weight"), geo.eps)
    cos, sin = rope[0][:t], rope[1][:t]
    q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    out = causal_attention(q, k, v.transpose(1, 2))
    y = tp.all_reduce(out @ w(f"{p}.o_proj.weight").T)
    bias = f"{p}.o_proj.bias"
    return y + w(bias) if has(bias) else y


def dense_mlp(x: torch.Tensor, w: Weights, p: str, act, tp: TensorParallel) -> torch.Tensor:
    """SwiGLU MLP of prefix ``p`` (``model.layers.i.mlp``): fused gate/up, row-parallel down."""
    gate, up = (x @ w(f"{p}.gate_up_proj.weight").T).chunk(2, dim=-1)
    return tp.all_reduce((act(gate) * up) @ w(f"{p}.down_proj.weight").T)


def route(x: torch.Tensor, router: torch.Tensor, geo: Geometry) -> tuple:
    """Qwen3-MoE and Mixtral routing: softmax over experts, top-k, renormalized if the
    architecture says so (``arch.norm_topk``: Qwen3-MoE's norm_topk_prob, always for Mixtral)."""
    probs = torch.softmax(x @ router.T, dim=-1)
    weights, ids = torch.topk(probs, geo.top_k, dim=-1)
    if geo.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe(x: torch.Tensor, w: Weights, p: str, geo: Geometry, act,
        tp: TensorParallel) -> torch.Tensor:
    """Sparse MoE block of prefix ``p``: this rank's share of the routed experts, reduced."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, ids = route(flat, w(f"{p}.gate.weight"), geo)
    w13, w2 = w(f"{p}.experts.w13_weight"), w(f"{p}.experts.w2_weight")
    out = torch.zeros_like(flat)
    for local, expert in enumerate(geo.experts):
        tokens, slot = torch.where(ids == expert)
        if tokens.numel() == 0:
            continue
        gate, up = (flat[tokens] @ w13[local].T).chunk(2, dim=-1)
        y = (act(gate) * up) @ w2[local].T
        out.index_add_(0, tokens, y * weights[tokens, slot, None])
    return tp.all_reduce(out).reshape(shape)
