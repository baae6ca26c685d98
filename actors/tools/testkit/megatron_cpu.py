"""Megatron-core on CPU for the tests and the demo: a small GPTModel from a model file.

megatron-core 0.16.1 builds and trains a ``GPTModel`` with the local layer spec (no
Transformer Engine) on CPU over gloo once three CUDA assumptions are side-stepped,
here and never in the transfer path (:func:`patch_for_cpu`, in processes without a
GPU): the RoPE cache moves its frequencies to ``torch.cuda.current_device()``,
attention forks the CUDA RNG tracker around its dropout, and the default causal mask
is made on ``"cuda"`` (:func:`causal_mask` gives the explicit one). MoE layers (a
``qwen3_moe`` model file: local experts, the allgather token dispatcher, EP from
``parallel_state``) need one more: without Transformer Engine the router's gating
reads ``moe_utils.te_general_gemm``, a name 0.16.1 defines only when TE imports (the
alltoall dispatcher also makes a ``torch.cuda.Stream`` when built, so it is not used)::

    patch_for_cpu()
    parallel_state.initialize_model_parallel(tp, pp)         # after init_process_group
    model = gpt_model(cfg, vocab_rows=1024)                  # cfg: a ModelConfig (tiny_llama)
    loss = model(tokens, positions(tokens), causal_mask(tokens), labels=labels)

Every rank builds its shards from the same full weights (``use_cpu_initialization``:
one seeded master tensor, each rank keeps its slice), so seed every rank alike.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# Megatron TransformerConfig fields an architecture adds to a Llama-style decoder
ARCH_FLAGS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"add_qkv_bias": True},
    "qwen3": {"qk_layernorm": True},
    "qwen3_moe": {"qk_layernorm": True},
}


def patch_for_cpu() -> None:
    """Side-step Megatron's CUDA assumptions in this process (nothing where CUDA runs)."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as rng
    from megatron.core.transformer.moe import moe_utils

    rng.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: torch.device("cpu")  # the RoPE cache's device
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # the router's gating then runs torch.mm


def gpt_model(cfg: Any, *, vocab_rows: int, dtype: torch.dtype = torch.bfloat16,
              pre_process: bool | None = None, post_process: bool | None = None) -> Any:
    """A ``GPTModel`` of ``cfg`` (a ModelConfig of a dense llama/qwen2/qwen3, or a
    qwen3_moe) with its vocabulary padded to ``vocab_rows``, on this rank's TP, PP and EP
    coordinates (the stage's ends from ``parallel_state`` unless given)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer import TransformerConfig

    if cfg.architecture not in ARCH_FLAGS:
        raise ValueError(f"no Megatron GPTModel for architecture {cfg.architecture!r}; "
                         f"known: {sorted(ARCH_FLAGS)}")
    flags = dict(ARCH_FLAGS[cfg.architecture])
    if cfg.n_experts:
        flags.update(moe_flags(cfg),
                     expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    config = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.kv_heads,
        kv_channels=cfg.head_size, ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps or 1e-6,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, use_cpu_initialization=True, attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, init_method_std=0.02,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(), **flags)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization="RMSNorm") if cfg.n_experts else \
        get_gpt_layer_local_spec(normalization="RMSNorm",
                                 qk_layernorm=flags.get("qk_layernorm", False))
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab_rows,
        max_sequence_length=cfg.max_position_embeddings or 2048,
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=int(cfg.rope_theta or 10000))


def moe_flags(cfg: Any) -> dict[str, Any]:
    """The TransformerConfig fields of ``cfg``'s MoE layers (Qwen3-MoE: a layer is MoE unless
    listed in ``mlp_only_layers``; softmax over the top k, the experts local modules)."""
    return {
        "num_moe_experts": cfg.n_experts, "moe_ffn_hidden_size": cfg.moe_intermediate_size,
        "moe_router_topk": cfg.num_experts_per_tok,
        "moe_layer_freq": [int(i not in cfg.mlp_only_layers
                               and (i + 1) % (cfg.decoder_sparse_step or 1) == 0)
                           for i in range(cfg.num_hidden_layers)],
        "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
    }


def positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1]).expand_as(tokens)


def causal_mask(tokens: torch.Tensor) -> torch.Tensor:
    """The ``[1, 1, s, s]`` boolean mask (True: masked) Megatron would make on CUDA."""
    s = tokens.shape[1]
    return torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
