"""Shared building blocks of the architecture modules: rule types, rule tables, parameter lists.

A :class:`Rule` says which engine (vLLM) tensor a group of trainer (Hugging Face)
parameters becomes: the trainer sources in fusion order (concatenated along the
output dimension, as vLLM's ``stacked_params_mapping`` loads them), how
tensor/expert parallelism cuts it (:class:`Split`), whether it is FP8
block-quantized when the engine runs FP8, and its dtype when that is not the
model dtype. Names are suffixes of ``model.layers.{i}.``; ``{e}`` in a source
stands for the expert index (``per_expert`` naming) and ``stacked`` gives the
sources under transformers-5 naming where they differ (the 3-D expert
parameters, Mixtral's router).

The tables below (GQA attention, MLA, dense MLP, routed experts) and the
parameter lists beside them (name suffix and global shape) are what the
modules of :mod:`weight_transfer.model.arch` combine; nothing here branches on an
architecture name.

What stays bf16 under FP8 (``fp8=False``): embeddings, lm_head, all norms,
biases, the MoE router and its correction bias - as DeepSeek-V3's FP8
checkpoint stores them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from weight_transfer.model.arch.shape import ModelShape
from weight_transfer.types import TensorSpec

Shape = tuple[int, ...]
Params = list[tuple[str, Shape]]  # (name suffix, global shape), in module order


class Split(enum.StrEnum):
    """How an engine tensor is cut across engine ranks (as vLLM's layers cut it)."""

    REPLICATED = "replicated"  # every rank holds all of it
    COLUMN = "column"  # output dim (0) over TP; each fused part cut separately
    QKV = "qkv"  # COLUMN, q by heads, k/v heads replicated when tp > num_kv_heads
    ROW = "row"  # input dim (1) over TP
    VOCAB = "vocab"  # dim 0 over TP as VocabParallelEmbedding (padded to 64 rows)
    EXPERTS_COLUMN = "experts_column"  # w13 [E_local, 2*inter, hidden]
    EXPERTS_ROW = "experts_row"  # w2 [E_local, hidden, inter]


EXPERT_SPLITS = (Split.EXPERTS_COLUMN, Split.EXPERTS_ROW)


@dataclass(frozen=True, slots=True)
class Rule:
    """One engine tensor and the trainer parameters it is built from (suffixes)."""

    engine: str
    sources: tuple[str, ...]
    split: Split
    fp8: bool = False
    dtype: str | None = None  # None: the model's torch_dtype
    stacked: tuple[str, ...] | None = None  # sources under "stacked" naming; None: same


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerParamSpec(TensorSpec):
    """One trainer parameter by its Hugging Face name, global shape and dtype; ``layer``
    is its decoder layer and ``expert`` its expert under per_expert naming (else None)."""

    expert: int | None = None
    layer: int | None = None


# vLLM's stacked_params_mapping: (engine module, trainer module, shard id).
STACKED_PARAMS_MAPPING: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
    ("fused_qkv_a_proj", "q_a_proj", 0),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
)


def fused(module: str, engine: str, suffix: str = "weight") -> tuple[str, ...]:
    """Trainer sources of the fused engine module ``engine`` inside ``module``."""
    return tuple(
        f"{module}.{trainer}.{suffix}" for e, trainer, _ in STACKED_PARAMS_MAPPING if e == engine
    )


def same(name: str, split: Split, fp8: bool = False, dtype: str | None = None) -> Rule:
    """A rule whose engine tensor has the trainer parameter's own name."""
    return Rule(name, (name,), split, fp8, dtype)


# --------------------------------------------------------------------------- rule tables

GQA_ATTENTION = (
    Rule("self_attn.qkv_proj.weight", fused("self_attn", "qkv_proj"), Split.QKV, fp8=True),
    same("self_attn.o_proj.weight", Split.ROW, fp8=True),
)
QKV_BIAS = (Rule("self_attn.qkv_proj.bias", fused("self_attn", "qkv_proj", "bias"), Split.QKV),)
O_BIAS = (same("self_attn.o_proj.bias", Split.REPLICATED),)
QK_NORM = (
    same("self_attn.q_norm.weight", Split.REPLICATED),
    same("self_attn.k_norm.weight", Split.REPLICATED),
)
DENSE_MLP = (
    Rule("mlp.gate_up_proj.weight", fused("mlp", "gate_up_proj"), Split.COLUMN, fp8=True),
    same("mlp.down_proj.weight", Split.ROW, fp8=True),
)
LAYER_NORMS = (
    same("input_layernorm.weight", Split.REPLICATED),
    same("post_attention_layernorm.weight", Split.REPLICATED),
)
EMBEDDINGS = (
    same("model.embed_tokens.weight", Split.VOCAB),
    same("model.norm.weight", Split.REPLICATED),
)
LM_HEAD = (same("lm_head.weight", Split.VOCAB),)


def gqa_rules(*, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> tuple[Rule, ...]:
    """Fused q/k/v attention with its optional biases and per-head q/k norms."""
    return (
        GQA_ATTENTION
        + (QKV_BIAS if qkv_bias else ())
        + (O_BIAS if o_bias else ())
        + (QK_NORM if qk_norm else ())
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeKeys:
    """How an architecture spells its MoE block.

    ``block`` is the module in the checkpoint and in vLLM (``model.layers.{i}.<block>``),
    ``gate``/``up``/``down`` the checkpoint's per-expert linear names (vLLM's
    ``ckpt_gate_proj_name`` ...), ``order`` the order the per-expert module lists
    them, and ``stacked_block`` the module transformers 5 builds with the router
    and the 3-D ``experts.gate_up_proj`` / ``experts.down_proj``.
    """

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    order: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    stacked_block: str = "mlp"


def router_rules(keys: MoeKeys) -> tuple[Rule, ...]:
    name = f"{keys.block}.gate.weight"
    return (Rule(name, (name,), Split.REPLICATED, stacked=(f"{keys.stacked_block}.gate.weight",)),)


def expert_rules(keys: MoeKeys) -> tuple[Rule, ...]:
    """vLLM FusedMoE ``w13_weight`` (gate rows, then up) and ``w2_weight``."""
    b, s = keys.block, keys.stacked_block
    return (
        Rule(
            f"{b}.experts.w13_weight",
            (f"{b}.experts.{{e}}.{keys.gate}.weight", f"{b}.experts.{{e}}.{keys.up}.weight"),
            Split.EXPERTS_COLUMN,
            fp8=True,
            stacked=(f"{s}.experts.gate_up_proj",),
        ),
        Rule(
            f"{b}.experts.w2_weight",
            (f"{b}.experts.{{e}}.{keys.down}.weight",),
            Split.EXPERTS_ROW,
            fp8=True,
            stacked=(f"{s}.experts.down_proj",),
        ),
    )


# --------------------------------------------------------------------------- parameter lists


def gqa_params(cfg: ModelShape, *, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> Params:
    """q/k/v/o projections in module order (each weight followed by its bias)."""
    h, hd = cfg.hidden_size, cfg.head_size
    q, kv = cfg.num_attention_heads * hd, cfg.kv_heads * hd
    out: Params = []
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append((f"self_attn.{proj}.weight", (rows, h)))
        if qkv_bias:
            out.append((f"self_attn.{proj}.bias", (rows,)))
    out.append(("self_attn.o_proj.weight", (h, q)))
    if o_bias:
        out.append(("self_attn.o_proj.bias", (h,)))
    if qk_norm:
        out += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    return out


def dense_mlp_params(prefix: str, h: int, inter: int) -> Params:
    """SwiGLU MLP ``prefix.{gate,up,down}_proj.weight`` (prefix "" gives ".gate_proj...")."""
    return [
        (f"{prefix}.gate_proj.weight", (inter, h)),
        (f"{prefix}.up_proj.weight", (inter, h)),
        (f"{prefix}.down_proj.weight", (h, inter)),
    ]


def specs(prefix: str, params: Params, dtype: str, layer: int | None) -> list[TrainerParamSpec]:
    return [
        TrainerParamSpec(name=prefix + n, shape=s, dtype=dtype, layer=layer) for n, s in params
    ]


def router_specs(
    cfg: ModelShape, layer: int, keys: MoeKeys, naming: str
) -> list[TrainerParamSpec]:
    block = keys.stacked_block if naming == "stacked" else keys.block
    name = f"model.layers.{layer}.{block}.gate.weight"
    shape = (cfg.n_experts, cfg.hidden_size)
    return [TrainerParamSpec(name=name, shape=shape, dtype=cfg.torch_dtype, layer=layer)]


def expert_specs(
    cfg: ModelShape, layer: int, keys: MoeKeys, naming: str
) -> list[TrainerParamSpec]:
    """Routed experts: three 2-D tensors per expert (per_expert, the checkpoint's names)
    or transformers 5's two 3-D parameters (stacked; gate rows first in gate_up_proj)."""
    e_count, inter, h = cfg.n_experts, cfg.expert_intermediate_size, cfg.hidden_size
    dt, i = cfg.torch_dtype, layer
    if naming == "stacked":
        p = f"model.layers.{i}.{keys.stacked_block}.experts."
        return [
            TrainerParamSpec(name=p + "gate_up_proj", shape=(e_count, 2 * inter, h), dtype=dt,
                             layer=i),
            TrainerParamSpec(name=p + "down_proj", shape=(e_count, h, inter), dtype=dt, layer=i),
        ]
    p = f"model.layers.{i}.{keys.block}.experts."
    shape = {keys.gate: (inter, h), keys.up: (inter, h), keys.down: (h, inter)}
    parts = [(f".{n}.weight", shape[n]) for n in keys.order]
    return [
        TrainerParamSpec(name=f"{p}{e}{n}", shape=s, dtype=dt, expert=e, layer=i)
        for e in range(e_count)
        for n, s in parts
    ]
