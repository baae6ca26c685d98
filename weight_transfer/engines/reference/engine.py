"""The reference inference engine: a small decoder holding one TP/EP shard in vLLM's layout.

It is what the demo and the tests transfer weights into. Its tensors have
exactly the names, shapes and dtypes of
:func:`weight_transfer.layout.engine_layout.engine_tensor_specs` (fused ``qkv_proj`` and
``gate_up_proj``, stacked ``w13``/``w2`` experts, vocab-parallel embedding and
head, optional FP8 weights with ``weight_scale_inv``), all views into one
registrable buffer (:class:`~weight_transfer.engines.reference.buffer.EngineBuffer`).
A weight update writes into that buffer from another process; the engine runs
no code during it and reads the new values at its next step::

    engine = ReferenceEngine(cfg, ShardSpec(tp_rank=r, tp_size=2), fp8=False, group=tp_group)
    engine.load_state(hf_state_dict)            # initial weights (reference loader)
    nic.register(engine.buffer)                 # one region per rank
    tokens = engine.generate([[1, 2, 3]], max_new_tokens=8)   # all TP ranks together

Architectures: those whose module says ``reference_engine`` (llama, qwen2 with
qkv bias, qwen3 with q/k norm, qwen3_moe, mixtral); deepseek_v3 (MLA) is a
ValueError. The MoE block's module name is the architecture's
(``arch.moe_keys.block``: ``mlp``, Mixtral's ``block_sparse_moe``). Everything
computes in float32: bf16 weights are upcast and FP8 weights dequantized with
their 128x128 block scales on use.
Generation is greedy and recomputes the whole prefix at every step, each step
inside ``step_guard()`` when one is set (the adapter's pause point).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from weight_transfer.engines.reference import layers as L
from weight_transfer.engines.reference.buffer import EngineBuffer
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.ops import (
    TensorParallel,
    activation,
    check_prompts,
    greedy_loop,
    rms_eps,
    rms_norm,
    rope_cos_sin,
    rope_theta,
)
from weight_transfer.layout.engine_layout import engine_tensor_specs
from weight_transfer.layout.quant import dequantize_fp8_blocks
from weight_transfer.model.arch import architecture_names, get_architecture
from weight_transfer.model.models import ModelConfig
from weight_transfer.model.naming import scale_name
from weight_transfer.sync.versions import Generation
from weight_transfer.types import ShardSpec

logger = logging.getLogger(__name__)


def supported_architectures() -> tuple[str, ...]:
    """Registered architectures the reference engine runs."""
    return tuple(n for n in architecture_names() if get_architecture(n).reference_engine)


class ReferenceEngine:
    """One engine rank: its weights in one buffer, and a TP forward over ``group``."""

    def __init__(self, cfg: ModelConfig, shard: ShardSpec, *, fp8: bool, group=None) -> None:
        if not cfg.arch.reference_engine:
            raise ValueError(
                f"{cfg.name or cfg.architecture}: architecture {cfg.architecture!r} is not "
                f"supported by the reference engine "
                f"(supported: {', '.join(supported_architectures())})"
            )
        self.cfg, self.shard, self.fp8 = cfg, shard, fp8
        self._moe_block = cfg.arch.moe_keys.block
        self.tp = TensorParallel(group, shard)
        self.act = activation(cfg)
        self.geo = L.geometry(cfg, shard, rms_eps(cfg))
        self._mem = EngineBuffer(engine_tensor_specs(cfg, shard, fp8=fp8))
        self.buffer, self.tensors, self.offsets = (
            self._mem.buffer, self._mem.tensors, self._mem.offsets)
        self._theta = rope_theta(cfg)
        self._rope = rope_cos_sin(0, cfg.head_size, self._theta)
        self.step_guard: Callable[[], AbstractContextManager] | None = None
        # The version the engine holds, read at every step by generate_tagged (set by the
        # rank that owns the engine; None: no versions known).
        self.version_of: Callable[[], Any] | None = None
        logger.info("reference engine %s tp%d/%d ep%d/%d fp8=%s: %d tensors, %d bytes",
                    cfg.name, shard.tp_rank, shard.tp_size, shard.ep_rank, shard.ep_size, fp8,
                    len(self.tensors), self._mem.nbytes)

    # ------------------------------------------------------------------ memory
    def specs(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        """``(name, shape, dtype, byte offset)`` of every tensor in :attr:`buffer`."""
        return self._mem.specs()

    def slots(self) -> list:
        """The layout of :attr:`buffer` (``TensorSlot`` per tensor): a second buffer built
        from it has the same offsets (shadow mode)."""
        return list(self._mem.slots)

    def load_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        """Initial weights: this shard of a Hugging Face state dict (reference loader)."""
        self._mem.fill(load_engine_shard(self.cfg, hf_state, self.shard, fp8=self.fp8))

    def state_bytes(self) -> dict[str, torch.Tensor]:
        """A uint8 copy of every tensor (name -> bytes), for checks."""
        return self._mem.state_bytes()

    def weight(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as float32 (FP8 dequantized with its block scales)."""
        t = self.tensors[name]
        if t.dtype == torch.float8_e4m3fn:
            return dequantize_fp8_blocks(t, self.tensors[scale_name(name)])
        return t.to(torch.float32)

    def _has(self, name: str) -> bool:
        return name in self.tensors

    # ------------------------------------------------------------------ compute
    def _rope_for(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope[0].shape[0] < t:
            self._rope = rope_cos_sin(max(t, 2 * self._rope[0].shape[0]), self.cfg.head_size,
                                      self._theta)
        return self._rope

    def _layer(self, h: torch.Tensor, i: int, rope) -> torch.Tensor:
        p, w, eps = f"model.layers.{i}", self.weight, self.geo.eps
        x = rms_norm(h, w(f"{p}.input_layernorm.weight"), eps)
        h = h + L.attention(x, w, self._has, f"{p}.self_attn", self.geo, self.tp, rope)
        x = rms_norm(h, w(f"{p}.post_attention_layernorm.weight"), eps)
        if self.cfg.is_moe_layer(i):
            return h + L.moe(x, w, f"{p}.{self._moe_block}", self.geo, self.act, self.tp)
        return h + L.dense_mlp(x, w, f"{p}.mlp", self.act, self.tp)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, T, vocab] of ``input_ids`` [B, T] (every TP rank calls it)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], not {tuple(input_ids.shape)}")
        embed = "model.embed_tokens.weight"
        head = embed if self.cfg.tie_word_embeddings else "lm_head.weight"
        table = self.weight(embed) if self._has(embed) else None
        h = L.embed(input_ids, table, self.geo, self.tp, self.cfg.hidden_size)
        rope = self._rope_for(input_ids.shape[1])
        for i in range(self.cfg.num_hidden_layers):
            h = self._layer(h, i, rope)
        h = rms_norm(h, self.weight("model.norm.weight"), self.geo.eps)
        table = self.weight(head) if self._has(head) else None
        return L.lm_head(h, table, self.geo, self.tp, self.cfg.vocab_size)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations (new tokens only); prompts of one length run as a batch.

        Every TP rank of the replica must call it with the same arguments. Each step
        runs inside ``step_guard()`` (a paused adapter holds the step back there).
        """
        check_prompts(prompts, self.cfg.vocab_size, max_new_tokens)
        return greedy_loop(
            prompts, max_new_tokens, lambda ids: self.forward(ids)[:, -1], self.step_guard
        )

    def generate_tagged(self, prompts: list[list[int]], max_new_tokens: int
                        ) -> list[Generation]:
        """:meth:`generate`, each sequence with the versions that produced its tokens (the
        version held read at every step, inside ``step_guard()``)."""
        check_prompts(prompts, self.cfg.vocab_size, max_new_tokens)
        version_of = self.version_of or (lambda: None)
        return greedy_loop(prompts, max_new_tokens, lambda ids: self.forward(ids)[:, -1],
                           self.step_guard, version_of)
