"""Megatron-core tensors as Hugging Face tensors, plainly: the tests' oracle, the demo's
Megatron trainer's ``full_state_dict`` and the bench's ``native`` design (slime's way).

Independent of the plan (:mod:`weight_transfer.sources.megatron_layout`): a full tensor
(gathered over TP by concatenation on ``partition_dim``) is renamed, and the fused ones
split — grouped QKV per query group into q, k and v, ``linear_fc1``'s per-rank
[gate; up] into gate and up — with the padded vocabulary rows dropped::

    for hf_name, t in hf_tensors(name, full, layers={0: 0, 1: 1}, first_expert=0,
                                 dims=HfDims(tp=2, heads=4, groups=2, vocab=1000)):
        ...
    state = hf_from_megatron(full, layers, first_expert, tp=2, heads=4, groups=2, vocab=1000)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

LAYER_NAMES = {  # Megatron suffix -> Hugging Face suffix (the unfused ones)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # qwen3
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")


@dataclass(frozen=True, slots=True)
class HfDims:
    """What the split needs: TP (fc1's per-rank blocks), heads, query groups, vocabulary."""

    tp: int
    heads: int
    groups: int
    vocab: int


def _gate_up(t: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    per_rank = t.view(tp, 2, -1, t.shape[1])  # each rank: its gate rows, then its up rows
    return per_rank[:, 0].reshape(-1, t.shape[1]), per_rank[:, 1].reshape(-1, t.shape[1])


def hf_tensors(name: str, t: torch.Tensor, *, layers: Mapping[int, int], first_expert: int,
               dims: HfDims) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face (name, tensor) pairs of Megatron's full tensor ``t`` of ``name``;
    ``layers``: stage layer index -> the model's; local expert ``j`` is the model's
    ``first_expert + j``. KeyError for a name no rule maps."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", t[: dims.vocab])]
    if name == "output_layer.weight":
        return [("lm_head.weight", t[: dims.vocab])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", t)]
    _, _, i, suffix = name.split(".", 3)
    p = f"model.layers.{layers[int(i)]}."
    if (m := EXPERT.fullmatch(suffix)) is not None:
        e = f"{p}mlp.experts.{first_expert + int(m.group(1))}."
        if m.group(2) == "linear_fc2":
            return [(e + "down_proj.weight", t)]
        gate, up = _gate_up(t, dims.tp)
        return [(e + "gate_proj.weight", gate), (e + "up_proj.weight", up)]
    if suffix == "mlp.router.weight":
        return [(p + "mlp.gate.weight", t)]
    if suffix == "self_attention.linear_qkv.weight":
        per_group = t.view(dims.groups, dims.heads // dims.groups + 2, -1, t.shape[1])
        q, k, v = per_group[:, :-2], per_group[:, -2], per_group[:, -1]
        return [(p + "self_attn.q_proj.weight", q.reshape(-1, t.shape[1])),
                (p + "self_attn.k_proj.weight", k.reshape(-1, t.shape[1])),
                (p + "self_attn.v_proj.weight", v.reshape(-1, t.shape[1]))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = _gate_up(t, dims.tp)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    return [(p + LAYER_NAMES[suffix], t)]


def hf_from_megatron(full: Mapping[str, torch.Tensor], layers: Mapping[int, int],
                     first_expert: int, *, tp: int, heads: int, groups: int,
                     vocab: int) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict of Megatron's full tensors (contiguous copies)."""
    dims = HfDims(tp=tp, heads=heads, groups=groups, vocab=vocab)
    out = {}
    for name, t in full.items():
        for hf_name, part in hf_tensors(name, t, layers=layers, first_expert=first_expert,
                                        dims=dims):
            out[hf_name] = part.contiguous()
    return out


# ------------------------------------------------------------------ on a trainer rank


def tp_full(name: str, p: torch.Tensor) -> torch.Tensor:
    """Parameter ``name`` gathered over its TP group (an expert's over expert TP) by
    concatenation on its ``partition_dim``; itself when Megatron does not cut it (a
    collective)."""
    from megatron.core import parallel_state as ps

    group = (ps.get_expert_tensor_parallel_group() if ".mlp.experts." in name
             else ps.get_tensor_model_parallel_group())
    world = torch.distributed.get_world_size(group)
    t = p.detach().contiguous()
    if not getattr(p, "tensor_model_parallel", False) or world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=p.partition_dim)


def full_shape(name: str, p: torch.Tensor) -> tuple[int, ...]:
    """The shape :func:`tp_full` gives parameter ``name`` (no collective)."""
    from megatron.core import parallel_state as ps

    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= (ps.get_expert_tensor_parallel_world_size()
                                   if ".mlp.experts." in name
                                   else ps.get_tensor_model_parallel_world_size())
    return tuple(shape)


def stage_layers(model: torch.nn.Module) -> dict[int, int]:
    """The stage's decoder layer index -> the model's (``layer_number`` counts from 1)."""
    return {i: int(n.layer_number) - 1 for i, n in enumerate(model.decoder.layers)}


def first_expert(model: torch.nn.Module) -> int:
    """The model's index of this rank's local expert 0."""
    from megatron.core import parallel_state as ps

    per_rank = (model.config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * per_rank


def model_dims(model: torch.nn.Module, vocab: int) -> HfDims:
    cfg = model.config
    return HfDims(tp=cfg.tensor_model_parallel_size, heads=cfg.num_attention_heads,
                  groups=cfg.num_query_groups, vocab=vocab)
