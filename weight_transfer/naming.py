"""Name-mapping and fusion rule tables: trainer (Hugging Face) names -> engine (vLLM) tensors.

Each :class:`Rule` says which engine tensor a group of trainer parameters
becomes: the trainer sources in fusion order (concatenated along the output
dimension, as vLLM's ``stacked_params_mapping`` loads them), how tensor/expert
parallelism cuts it (:class:`Split`), whether it is FP8 block-quantized when the
engine runs FP8, and its dtype when that is not the model dtype. Rules are
plain tables per architecture block; :func:`bound_rules` instantiates them for
every layer of a config with full names. ``{e}`` in a source stands for the
expert index (``per_expert`` naming); :data:`STACKED_EXPERT_SOURCES` gives the
transformers-5 3-D parameter that replaces those sources (``stacked`` naming).

What stays bf16 under FP8 (``fp8=False`` in the tables): embeddings, lm_head,
all norms, biases, the MoE router and its correction bias - as DeepSeek-V3's
FP8 checkpoint stores them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from weight_transfer.models import ModelConfig


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


def _fused(module: str, engine: str, suffix: str = "weight") -> tuple[str, ...]:
    return tuple(
        f"{module}.{trainer}.{suffix}" for e, trainer, _ in STACKED_PARAMS_MAPPING if e == engine
    )


def _same(name: str, split: Split, fp8: bool = False, dtype: str | None = None) -> Rule:
    return Rule(name, (name,), split, fp8, dtype)


GQA_ATTENTION = (
    Rule("self_attn.qkv_proj.weight", _fused("self_attn", "qkv_proj"), Split.QKV, fp8=True),
    _same("self_attn.o_proj.weight", Split.ROW, fp8=True),
)
QKV_BIAS = (Rule("self_attn.qkv_proj.bias", _fused("self_attn", "qkv_proj", "bias"), Split.QKV),)
O_BIAS = (_same("self_attn.o_proj.bias", Split.REPLICATED),)
QK_NORM = (
    _same("self_attn.q_norm.weight", Split.REPLICATED),
    _same("self_attn.k_norm.weight", Split.REPLICATED),
)
MLA_Q_LORA = (
    Rule(
        "self_attn.fused_qkv_a_proj.weight",
        _fused("self_attn", "fused_qkv_a_proj"),
        Split.REPLICATED,
        fp8=True,
    ),
    _same("self_attn.q_a_layernorm.weight", Split.REPLICATED),
    _same("self_attn.q_b_proj.weight", Split.COLUMN, fp8=True),
)
MLA_Q_FULL = (
    _same("self_attn.q_proj.weight", Split.COLUMN, fp8=True),
    _same("self_attn.kv_a_proj_with_mqa.weight", Split.REPLICATED, fp8=True),
)
MLA_KV = (
    _same("self_attn.kv_a_layernorm.weight", Split.REPLICATED),
    _same("self_attn.kv_b_proj.weight", Split.COLUMN, fp8=True),
    _same("self_attn.o_proj.weight", Split.ROW, fp8=True),
)
DENSE_MLP = (
    Rule("mlp.gate_up_proj.weight", _fused("mlp", "gate_up_proj"), Split.COLUMN, fp8=True),
    _same("mlp.down_proj.weight", Split.ROW, fp8=True),
)
ROUTER = (_same("mlp.gate.weight", Split.REPLICATED),)
ROUTER_BIAS = (_same("mlp.gate.e_score_correction_bias", Split.REPLICATED, dtype="float32"),)
EXPERTS = (
    Rule(
        "mlp.experts.w13_weight",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        Split.EXPERTS_COLUMN,
        fp8=True,
    ),
    Rule("mlp.experts.w2_weight", ("mlp.experts.{e}.down_proj.weight",), Split.EXPERTS_ROW, True),
)
SHARED_EXPERTS = (
    Rule(
        "mlp.shared_experts.gate_up_proj.weight",
        _fused("mlp.shared_experts", "gate_up_proj"),
        Split.COLUMN,
        fp8=True,
    ),
    _same("mlp.shared_experts.down_proj.weight", Split.ROW, fp8=True),
)
LAYER_NORMS = (
    _same("input_layernorm.weight", Split.REPLICATED),
    _same("post_attention_layernorm.weight", Split.REPLICATED),
)
EMBEDDINGS = (
    _same("model.embed_tokens.weight", Split.VOCAB),
    _same("model.norm.weight", Split.REPLICATED),
)
LM_HEAD = (_same("lm_head.weight", Split.VOCAB),)

# transformers-5 stacked experts: engine tensor -> the one 3-D trainer parameter.
STACKED_EXPERT_SOURCES: dict[str, str] = {
    "mlp.experts.w13_weight": "mlp.experts.gate_up_proj",
    "mlp.experts.w2_weight": "mlp.experts.down_proj",
}

# Wrapper prefixes that FSDP, activation checkpointing and torch.compile add to names.
TRAINER_NAME_REWRITES: tuple[tuple[str, str], ...] = (
    ("_orig_mod.", ""),
    ("_fsdp_wrapped_module.", ""),
    ("_checkpoint_wrapped_module.", ""),
    ("module.", ""),
)

# Trainer names that need no destination, per condition (tied: vLLM shares one tensor).
TIED_ALIASES = ("lm_head.weight",)


def canonical_trainer_name(name: str) -> str:
    """Strip wrapper prefixes (FSDP, checkpointing, torch.compile) from a trainer name."""
    for old, new in TRAINER_NAME_REWRITES:
        if old in name:
            name = name.replace(old, new)
    return name


def layer_blocks(cfg: ModelConfig, layer: int) -> tuple[Rule, ...]:
    """The rule table of one decoder layer of ``cfg`` (attention, MLP or MoE, norms)."""
    if cfg.architecture == "deepseek_v3":
        attention = (MLA_Q_LORA if cfg.q_lora_rank else MLA_Q_FULL) + MLA_KV
    else:
        attention = GQA_ATTENTION
        attention += QKV_BIAS if cfg.qkv_bias else ()
        attention += O_BIAS if cfg.o_bias else ()
        attention += QK_NORM if cfg.architecture in ("qwen3", "qwen3_moe") else ()
    if not cfg.is_moe_layer(layer):
        mlp = DENSE_MLP
    else:
        mlp = ROUTER + (ROUTER_BIAS if cfg.has_router_bias else ()) + EXPERTS
        shared = cfg.architecture == "deepseek_v3" and cfg.n_shared_experts
        mlp += SHARED_EXPERTS if shared else ()
    return attention + mlp + LAYER_NORMS


@dataclass(frozen=True, slots=True)
class BoundRule:
    """A rule with full names for one layer (``layer`` None: model-level tensors)."""

    engine: str
    sources: tuple[str, ...]
    split: Split
    fp8: bool
    dtype: str
    layer: int | None


def bound_rules(cfg: ModelConfig) -> tuple[BoundRule, ...]:
    """Every engine tensor of the model with its full trainer source names (memoized)."""
    return cfg.cached("bound_rules", lambda: _bind(cfg))


def _bind(cfg: ModelConfig) -> tuple[BoundRule, ...]:
    def bind(rule: Rule, prefix: str, layer: int | None) -> BoundRule:
        return BoundRule(
            engine=prefix + rule.engine,
            sources=tuple(prefix + s for s in rule.sources),
            split=rule.split,
            fp8=rule.fp8,
            dtype=rule.dtype or cfg.torch_dtype,
            layer=layer,
        )

    out = [bind(EMBEDDINGS[0], "", None)]
    for i in range(cfg.num_hidden_layers):
        out += [bind(r, f"model.layers.{i}.", i) for r in layer_blocks(cfg, i)]
    out.append(bind(EMBEDDINGS[1], "", None))
    if not cfg.tie_word_embeddings:
        out += [bind(r, "", None) for r in LM_HEAD]
    return tuple(out)


def expert_sources(rule: BoundRule, expert: int, expert_naming: str) -> tuple[str, ...]:
    """Trainer names of one expert's parts (per_expert) or the stacked 3-D parameter."""
    if expert_naming == "stacked":
        prefix, _, suffix = rule.engine.rpartition("mlp.experts.")
        return (prefix + STACKED_EXPERT_SOURCES["mlp.experts." + suffix],)
    return tuple(s.replace("{e}", str(expert)) for s in rule.sources)


def all_sources(cfg: ModelConfig, rule: BoundRule, expert_naming: str) -> tuple[str, ...]:
    """Every trainer name a rule reads, over all experts."""
    if rule.split not in EXPERT_SPLITS:
        return rule.sources
    if expert_naming == "stacked":
        return expert_sources(rule, 0, expert_naming)
    return tuple(s for e in range(cfg.n_experts) for s in expert_sources(rule, e, expert_naming))


def scale_name(engine: str) -> str:
    """vLLM's name of the FP8 block scales of a weight (``weight_scale_inv``)."""
    if engine.endswith("weight"):  # "x.weight" and "w13_weight" alike
        return engine + "_scale_inv"
    raise ValueError(f"no FP8 scale name for engine tensor {engine!r}")


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def name_problems(
    cfg: ModelConfig, expert_naming: str, trainer_names: Iterable[str], ignore: tuple[str, ...]
) -> list[str]:
    """Lines listing trainer names without a destination and engine tensors without
    a source (both directions, all of them); names matching ``ignore`` are exempt."""
    names = {canonical_trainer_name(n) for n in trainer_names}
    used: set[str] = set()
    no_source: list[str] = []
    for rule in bound_rules(cfg):
        if matches(rule.engine, ignore):
            continue
        sources = all_sources(cfg, rule, expert_naming)
        used.update(sources)
        missing = [s for s in sources if s not in names]
        if missing:
            no_source.append(f"{rule.engine} (missing {', '.join(missing)})")
    aliases = TIED_ALIASES if cfg.tie_word_embeddings else ()
    no_dest = sorted(
        n for n in names if n not in used and n not in aliases and not matches(n, ignore)
    )
    problems = []
    if no_dest:
        problems.append(f"{len(no_dest)} trainer parameters without a destination:")
        problems += [f"  {n}" for n in no_dest]
    if no_source:
        problems.append(f"{len(no_source)} engine tensors without a source:")
        problems += [f"  {n}" for n in no_source]
    return problems
