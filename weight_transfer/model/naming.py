"""Name mapping: trainer (Hugging Face) names -> engine (vLLM) tensors, for a whole model.

The rule tables live with their architecture (:mod:`weight_transfer.model.arch`; the
shared :class:`Rule`, :class:`Split` and tables in
:mod:`weight_transfer.model.arch.common`). :func:`bound_rules` instantiates the
architecture's table for every layer of a config with full names::

    for rule in bound_rules(cfg):            # model.layers.3.self_attn.qkv_proj.weight ...
        all_sources(cfg, rule, "stacked")    # the trainer names it reads

``{e}`` in a source stands for the expert index (``per_expert`` naming); under
``stacked`` naming a rule reads ``rule.stacked`` instead (transformers 5's 3-D
expert parameters, Mixtral's ``mlp.gate.weight``). :func:`name_problems` lists
trainer names without a destination and engine tensors without a source.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from weight_transfer.model.arch.common import (
    EMBEDDINGS,
    EXPERT_SPLITS,
    LM_HEAD,
    STACKED_PARAMS_MAPPING,
    Rule,
    Split,
)
from weight_transfer.model.models import ModelConfig

__all__ = [
    "EXPERT_SPLITS",
    "STACKED_PARAMS_MAPPING",
    "TIED_ALIASES",
    "BoundRule",
    "Rule",
    "Split",
    "all_sources",
    "bound_rules",
    "canonical_trainer_name",
    "expert_sources",
    "layer_blocks",
    "matches",
    "name_problems",
    "rule_sources",
    "scale_name",
    "unmapped_trainer_names",
]

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
    return cfg.arch.layer_rules(cfg, layer)


@dataclass(frozen=True, slots=True)
class BoundRule:
    """A rule with full names for one layer (``layer`` None: model-level tensors)."""

    engine: str
    sources: tuple[str, ...]
    split: Split
    fp8: bool
    dtype: str
    layer: int | None
    stacked: tuple[str, ...]  # sources under "stacked" naming (experts: the 3-D parameter)


def bound_rules(cfg: ModelConfig) -> tuple[BoundRule, ...]:
    """Every engine tensor of the model with its full trainer source names (memoized)."""
    return cfg.cached("bound_rules", lambda: _bind(cfg))


def _bind(cfg: ModelConfig) -> tuple[BoundRule, ...]:
    def bind(rule: Rule, prefix: str, layer: int | None) -> BoundRule:
        sources = tuple(prefix + s for s in rule.sources)
        return BoundRule(
            engine=prefix + rule.engine,
            sources=sources,
            split=rule.split,
            fp8=rule.fp8,
            dtype=rule.dtype or cfg.torch_dtype,
            layer=layer,
            stacked=sources if rule.stacked is None else tuple(prefix + s for s in rule.stacked),
        )

    out = [bind(EMBEDDINGS[0], "", None)]
    for i in range(cfg.num_hidden_layers):
        out += [bind(r, f"model.layers.{i}.", i) for r in layer_blocks(cfg, i)]
    out.append(bind(EMBEDDINGS[1], "", None))
    if not cfg.tie_word_embeddings:
        out += [bind(r, "", None) for r in LM_HEAD]
    return tuple(out)


def rule_sources(rule: BoundRule, expert_naming: str) -> tuple[str, ...]:
    """Trainer names a rule reads under ``expert_naming`` (``{e}`` left in per-expert names)."""
    return rule.stacked if expert_naming == "stacked" else rule.sources


def expert_sources(rule: BoundRule, expert: int, expert_naming: str) -> tuple[str, ...]:
    """Trainer names of one expert's parts (per_expert) or the stacked 3-D parameter."""
    if expert_naming == "stacked":
        return rule.stacked
    return tuple(s.replace("{e}", str(expert)) for s in rule.sources)


def all_sources(cfg: ModelConfig, rule: BoundRule, expert_naming: str) -> tuple[str, ...]:
    """Every trainer name a rule reads, over all experts."""
    if rule.split not in EXPERT_SPLITS:
        return rule_sources(rule, expert_naming)
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


def unmapped_trainer_names(cfg: ModelConfig, expert_naming: str,
                           trainer_names: Iterable[str]) -> list[str]:
    """The trainer names (canonical) that no rule of ``cfg``'s architecture reads, in the
    order given; tied aliases and ``cfg.ignore_params`` are exempt."""
    used = {s for rule in bound_rules(cfg) for s in all_sources(cfg, rule, expert_naming)}
    aliases = TIED_ALIASES if cfg.tie_word_embeddings else ()
    out = []
    for n in trainer_names:
        c = canonical_trainer_name(n)
        if c not in used and c not in aliases and not matches(c, tuple(cfg.ignore_params)):
            out.append(c)
    return out


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
