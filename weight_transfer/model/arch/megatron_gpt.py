"""Megatron-core ``GPTModel`` names of the dense decoder family (llama, qwen2, qwen3), as tables.

A Megatron GPTModel holds the same weights as the Hugging Face model under other names,
some of them fused, each cut over the tensor-parallel (TP) group along its
``partition_dim``:

* ``decoder.layers.{i}.self_attention.linear_qkv.weight`` (and ``.bias``) is q, k and v
  in one tensor, laid out per query group: the group's q heads, then its k head, then
  its v head. TP cuts it on dim 0 by whole groups, so a rank holds, per group of its
  own, those three bands (:data:`PART_SPANS`);
* ``decoder.layers.{i}.mlp.linear_fc1.weight`` is gate and up: each rank holds its gate
  rows, then its up rows (the halves of its shard);
* ``embedding.word_embeddings.weight`` and ``output_layer.weight`` hold the vocabulary
  padded (Megatron-LM pads it to a multiple of 128 x TP): rows past the Hugging Face
  ``vocab_size`` are never read;
* ``{i}`` is the layer's index in its pipeline stage (and virtual chunk); its
  ``layer_number - 1`` is the model's.

Both the local layer spec's names (``input_layernorm``, ``pre_mlp_layernorm``) and
Transformer Engine's (the norm fused into the next linear: ``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``) are accepted. Each rule names the Hugging Face
parameters in the order of the fused parts and the dim Megatron cuts over TP (None:
every TP rank holds it whole)::

    rule, names = map_megatron_name("decoder.layers.1.mlp.linear_fc1.weight", {1: 5})
    names  # ("model.layers.5.mlp.gate_proj.weight", "model.layers.5.mlp.up_proj.weight")
    part_bands(rule.fusion, 0, rows=256, groups=1, q_per_group=1)  # the gate half

Pure Python: no torch, no megatron.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LAYER_RULES", "MODEL_RULES", "PART_SPANS", "Bands", "Fusion", "MegatronRule",
           "map_megatron_name", "part_bands"]


class Fusion(enum.StrEnum):
    """How a Megatron tensor holds several Hugging Face parameters (rows of its TP shard)."""

    NONE = "none"  # one parameter
    QKV = "qkv"  # per query group of the shard: its q heads, then k, then v
    GATE_UP = "gate_up"  # the shard's gate rows, then its up rows


@dataclass(frozen=True, slots=True)
class MegatronRule:
    """A Megatron parameter (name suffix), the Hugging Face parameters it holds (suffixes,
    in the order of its fused parts), how it fuses them, the dim TP cuts (None: whole
    on every TP rank), and whether it is an MoE expert's
    (:mod:`weight_transfer.model.arch.megatron_moe`)."""

    megatron: str
    hf: tuple[str, ...]
    fusion: Fusion = Fusion.NONE
    partition_dim: int | None = None
    expert: bool = False  # an MoE expert's: on the expert mesh, cut over expert TP


def _qkv(suffix: str) -> tuple[str, ...]:
    return tuple(f"self_attn.{p}_proj.{suffix}" for p in ("q", "k", "v"))


# decoder.layers.{i}.<megatron> -> model.layers.{layer_number - 1}.<hf>
LAYER_RULES: tuple[MegatronRule, ...] = (
    MegatronRule("input_layernorm.weight", ("input_layernorm.weight",)),
    MegatronRule("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
    MegatronRule("self_attention.linear_qkv.weight", _qkv("weight"), Fusion.QKV, 0),
    MegatronRule("self_attention.linear_qkv.bias", _qkv("bias"), Fusion.QKV, 0),
    MegatronRule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    MegatronRule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
    MegatronRule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",),
                 partition_dim=1),
    MegatronRule("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",)),
    MegatronRule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
    MegatronRule("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",)),
    MegatronRule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                 Fusion.GATE_UP, 0),
    MegatronRule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), partition_dim=1),
)
# whole-model names, as they are
MODEL_RULES: tuple[MegatronRule, ...] = (
    MegatronRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                 partition_dim=0),
    MegatronRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    MegatronRule("output_layer.weight", ("lm_head.weight",), partition_dim=0),
)

_BY_LAYER = {r.megatron: r for r in LAYER_RULES}
_BY_MODEL = {r.megatron: r for r in MODEL_RULES}
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def map_megatron_name(name: str, global_layer: Mapping[int, int]
                      ) -> tuple[MegatronRule, tuple[str, ...]] | None:
    """The rule of Megatron parameter ``name`` and the full Hugging Face names it holds
    (``global_layer``: the stage's layer index -> the model's), or None if no rule maps it."""
    if name in _BY_MODEL:
        rule = _BY_MODEL[name]
        return rule, rule.hf
    m = _LAYER_NAME.fullmatch(name)
    if m is None or m.group(2) not in _BY_LAYER or int(m.group(1)) not in global_layer:
        return None
    rule = _BY_LAYER[m.group(2)]
    prefix = f"model.layers.{global_layer[int(m.group(1))]}."
    return rule, tuple(prefix + s for s in rule.hf)


# Fusion -> per part (start, count) in units of one period of the shard's rows:
# QKV: a query group of q_per_group + 2 heads (q heads, the k head, the v head);
# GATE_UP: the shard's two halves.
PART_SPANS = {
    Fusion.NONE: lambda qpg: ((0, 1),),
    Fusion.QKV: lambda qpg: ((0, qpg), (qpg, 1), (qpg + 1, 1)),
    Fusion.GATE_UP: lambda qpg: ((0, 1), (1, 1)),
}


@dataclass(frozen=True, slots=True)
class Bands:
    """Rows ``[(g * period + start) * unit, (g * period + start + count) * unit)`` of a
    shard for each ``g`` in ``range(groups)``: one Hugging Face part of a fused shard."""

    unit: int
    period: int
    start: int
    count: int
    groups: int = 1

    @property
    def rows(self) -> int:
        return self.groups * self.count * self.unit

    def ranges(self) -> list[tuple[int, int]]:
        return [((g * self.period + self.start) * self.unit,
                 (g * self.period + self.start + self.count) * self.unit)
                for g in range(self.groups)]


def part_bands(fusion: Fusion, part: int, *, rows: int, groups: int, q_per_group: int
               ) -> Bands:
    """The rows of fused part ``part`` in a TP shard of ``rows`` rows holding ``groups``
    query groups of ``q_per_group`` q heads each (QKV; the other fusions hold one group);
    ValueError if the rows do not split so."""
    spans = PART_SPANS[fusion](q_per_group)
    groups = groups if fusion == Fusion.QKV else 1
    period = sum(n for _, n in spans)
    if rows % (groups * period):
        raise ValueError(f"{rows} rows do not split into {groups} x {period} equal bands "
                         f"({fusion} fusion)")
    start, count = spans[part]
    return Bands(unit=rows // (groups * period), period=period, start=start, count=count,
                 groups=groups)
