"""Float32 building blocks of the reference engine: norms, RoPE, attention, TP collectives.

Every function takes and returns float32 tensors and matches the arithmetic of
the Hugging Face modules it stands in for (``LlamaRMSNorm``, the default RoPE
with ``rotate_half``, causal GQA attention with scale ``head_dim ** -0.5``).
:class:`TensorParallel` wraps the replica's torch.distributed group and turns
every collective into a no-op at TP1, so one forward serves both::

    tp = TensorParallel(group, tp_rank=shard.tp_rank, tp_size=shard.tp_size)
    h = tp.all_reduce(x @ w_local.T)          # row-parallel matmul
    logits = tp.all_gather_last(local, rows)  # vocab-parallel head

:func:`rope_theta` and :func:`rms_eps` give the values both the engine and the
Hugging Face config use when a model config leaves them out, and
:func:`check_prompts` validates generation inputs the same way for both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weight_transfer.model.models import ModelConfig
from weight_transfer.sync.versions import Generation, VersionRecorder
from weight_transfer.types import ShardSpec

DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_EPS = 1e-6
ACTIVATIONS = {"silu": F.silu}


def rope_theta(cfg: ModelConfig) -> float:
    """RoPE base; ValueError for scaled RoPE variants (not implemented by the engine)."""
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) not in (
        None,
        "default",
    ):
        raise ValueError(
            f"{cfg.name or cfg.architecture}: rope_scaling {cfg.rope_scaling} is not supported "
            "by the reference engine (default RoPE only)"
        )
    return DEFAULT_ROPE_THETA if cfg.rope_theta is None else float(cfg.rope_theta)


def rms_eps(cfg: ModelConfig) -> float:
    return DEFAULT_RMS_EPS if cfg.rms_norm_eps is None else float(cfg.rms_norm_eps)


def activation(cfg: ModelConfig):
    try:
        return ACTIVATIONS[cfg.hidden_act]
    except KeyError:
        raise ValueError(
            f"{cfg.name or cfg.architecture}: hidden_act {cfg.hidden_act!r} is not supported "
            f"by the reference engine (supported: {sorted(ACTIVATIONS)})"
        ) from None


def check_prompts(prompts: list[list[int]], vocab_size: int, max_new_tokens: int) -> None:
    """ValueError naming the first bad prompt (empty, or a token outside the vocabulary)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
            )


def greedy_loop(
    prompts: list[list[int]],
    max_new_tokens: int,
    last_logits: Callable[[torch.Tensor], torch.Tensor],
    step_guard: Callable[[], contextlib.AbstractContextManager] | None = None,
    version_of: Callable[[], Any] | None = None,
) -> list[list[int]] | list[Generation]:
    """Greedy continuations (new tokens only); prompts of one length run as a batch.

    ``last_logits(ids)`` gives the logits of the last position of each row; each
    step recomputes the whole prefix and runs inside ``step_guard()`` if given.
    With ``version_of`` (the version the engine holds, read inside each step's
    guard) the result is one :class:`~weight_transfer.sync.versions.Generation` per
    prompt, its spans the versions that produced its tokens.
    """
    out: list[list[int]] = [[] for _ in prompts]
    tagged: list[Generation | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx], dtype=torch.long)
        rec = VersionRecorder(len(idx))
        for _ in range(max_new_tokens):
            with step_guard() if step_guard else contextlib.nullcontext():
                if version_of is not None:
                    rec.step(version_of())
                nxt = last_logits(ids).argmax(dim=-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        rows = [ids[row, len(prompts[i]) :].tolist() for row, i in enumerate(idx)]
        gens = rec.generations(rows) if version_of is not None else [None] * len(idx)
        for row, i in enumerate(idx):
            out[i], tagged[i] = rows[row], gens[row]
    return out if version_of is None else tagged


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def rope_cos_sin(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim] for positions 0..seq_len-1 (default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; rotate pairs (i, i + head_dim/2) as HF's rotate_half."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [B, H, T, D], k/v: [B, KV, T, D] with H a multiple of KV -> [B, T, H * D]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


class TensorParallel:
    """The TP group of one replica; collectives are no-ops at tp_size 1."""

    def __init__(self, group, shard: ShardSpec) -> None:
        self.group, self.rank, self.size = group, shard.tp_rank, shard.tp_size
        if self.size == 1:
            return
        if group is None:
            raise ValueError(f"tp_size={self.size} needs a process group over the TP ranks")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if (world, rank) != (self.size, self.rank):
            raise ValueError(
                f"process group has rank {rank} of {world}, but the shard is "
                f"tp_rank {self.rank} of {self.size}"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor, per_rank: int) -> torch.Tensor:
        """Concatenate every rank's last dimension, each padded to ``per_rank`` first."""
        if x.shape[-1] < per_rank:
            x = F.pad(x, (0, per_rank - x.shape[-1]))
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_max(self, value: int) -> int:
        """The largest ``value`` over the group (every rank must call it)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())
