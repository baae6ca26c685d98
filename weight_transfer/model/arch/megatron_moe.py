"""Megatron-core ``GPTModel`` names of MoE layers (the Qwen3-MoE family), as tables.

A Megatron MoE layer holds, beside the dense family's attention and norms
(:mod:`weight_transfer.model.arch.megatron_gpt`):

* ``decoder.layers.{i}.mlp.router.weight``: the router, whole on every rank (Hugging
  Face ``mlp.gate.weight``);
* the experts of this rank's expert-parallel (EP) rank, numbered locally: the local
  spec's ``mlp.experts.local_experts.{j}.linear_fc1.weight`` (and ``linear_fc2``) or
  Transformer Engine's grouped ``mlp.experts.linear_fc1.weight{j}``. Local expert ``j``
  of EP rank ``r`` is the model's expert ``r * experts_per_rank + j``. Each expert's
  ``linear_fc1`` is its gate rows then its up rows, cut over the expert tensor-parallel
  (ETP) group like the dense ``linear_fc1`` (each ETP rank: its gate, then its up);
  ``linear_fc2`` is cut on dim 1.

Expert rules say ``expert=True``: the source places them on the expert mesh (expert
data parallel x ETP), not the stage's (dp, tp) mesh::

    rule, names = map_expert_name("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
                                  {1: 1}, first_expert=4, experts_per_rank=4)
    names  # ("model.layers.1.mlp.experts.6.down_proj.weight",)

Pure Python: no torch, no megatron.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from weight_transfer.model.arch.megatron_gpt import Fusion, MegatronRule

__all__ = ["EXPERT_RULES", "ROUTER_RULES", "map_expert_name"]

_EXPERT = "mlp.experts.{e}."
# an expert's <megatron> -> model.layers.{layer}.mlp.experts.{expert}.<hf>
EXPERT_RULES: tuple[MegatronRule, ...] = (
    MegatronRule("linear_fc1.weight", (_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"),
                 Fusion.GATE_UP, 0, expert=True),
    MegatronRule("linear_fc2.weight", (_EXPERT + "down_proj.weight",), partition_dim=1,
                 expert=True),
)
# decoder.layers.{i}.<megatron> -> model.layers.{layer}.<hf>
ROUTER_RULES: tuple[MegatronRule, ...] = (
    MegatronRule("mlp.router.weight", ("mlp.gate.weight",)),
)

_BY_EXPERT = {r.megatron: r for r in EXPERT_RULES}
_BY_ROUTER = {r.megatron: r for r in ROUTER_RULES}
_LOCAL = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)")
_GROUPED = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.(linear_fc[12]\.weight)(\d+)")
_ROUTER = re.compile(r"decoder\.layers\.(\d+)\.(mlp\.router\..+)")


def map_expert_name(name: str, global_layer: Mapping[int, int], *, first_expert: int,
                    experts_per_rank: int) -> tuple[MegatronRule, tuple[str, ...]] | None:
    """The rule of MoE parameter ``name`` and the full Hugging Face names it holds
    (``global_layer``: the stage's layer index -> the model's; ``first_expert``: the
    model's index of this EP rank's local expert 0), or None if no rule maps it (a local
    expert index past ``experts_per_rank`` included)."""
    if (m := _ROUTER.fullmatch(name)) is not None:
        layer, rule, expert = m.group(1), _BY_ROUTER.get(m.group(2)), None
    elif (m := _LOCAL.fullmatch(name)) is not None:
        layer, rule, expert = m.group(1), _BY_EXPERT.get(m.group(3)), int(m.group(2))
    elif (m := _GROUPED.fullmatch(name)) is not None:
        layer, rule, expert = m.group(1), _BY_EXPERT.get(m.group(2)), int(m.group(3))
    else:
        return None
    if rule is None or int(layer) not in global_layer or (
            expert is not None and expert >= experts_per_rank):
        return None
    prefix = f"model.layers.{global_layer[int(layer)]}."
    e = None if expert is None else first_expert + expert
    return rule, tuple(prefix + s.format(e=e) for s in rule.hf)
