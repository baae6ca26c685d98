"""Trainer metadata of a Megatron trainer from a model config and ``trainer.megatron``, no torch.

What :mod:`weight_transfer.sources.megatron_layout` reads off a live Megatron model,
built here from the model's Hugging Face parameters and the cluster's layout
(:mod:`scheduling.cluster.megatron`), so that ``wt plan`` and ``wt simulate`` plan a
Megatron trainer at Kimi-K2 scale::

    tm = megatron_trainer_meta(cfg, cluster)   # cluster.trainer.megatron is set

Each Hugging Face parameter lands where Megatron keeps it:

* a layer's on the ``(dp, tp)`` mesh of the pipeline stage holding the layer, the
  embedding on the first stage's, the final norm and ``lm_head`` on the last's;
  ``(Replicate(), Shard(d))`` when TP cuts it on dim ``d``, ``(Replicate(),
  Replicate())`` when every TP rank holds it whole;
* an expert's on the ``(edp, etp)`` mesh of its EP rank in its layer's stage, cut over
  expert TP on the dim the Megatron table says.

The dims come from the Megatron name tables of the live source
(:mod:`weight_transfer.model.arch.megatron_gpt`, ``megatron_moe``) read by their
Hugging Face side, plus :data:`EXTRA_TP_DIMS` for what those tables do not hold yet
(Multi-Latent Attention and shared experts, as Megatron-core builds them). A fused
Megatron tensor's parts (grouped QKV, ``linear_fc1``'s gate and up halves) are each
their Hugging Face parameter's ``Shard`` block, so the planner sees them as such.
"""

from __future__ import annotations

import re

from scheduling.cluster.config import ClusterConfig
from scheduling.cluster.megatron import check_experts, dense_mesh, expert_mesh, layer_stages
from weight_transfer.model.arch.megatron_gpt import LAYER_RULES, MODEL_RULES
from weight_transfer.model.arch.megatron_moe import EXPERT_RULES, ROUTER_RULES
from weight_transfer.model.models import ModelConfig, trainer_param_specs
from weight_transfer.types import MeshDesc, ParamMeta, Placement, TrainerMeta

__all__ = ["EXTRA_TP_DIMS", "megatron_trainer_meta", "tp_dim"]

# Hugging Face suffix -> the dim Megatron-core cuts over TP (None: whole on every TP rank),
# beyond the live source's tables. MLA (multi_latent_attention.py): linear_q_down_proj and
# linear_kv_down_proj are "duplicated" over TP, linear_q_up_proj and linear_kv_up_proj are
# column parallel; the router's expert bias is whole; shared experts are the dense MLP's.
EXTRA_TP_DIMS: dict[str, int | None] = {
    "self_attn.q_a_proj.weight": None,
    "self_attn.q_a_layernorm.weight": None,
    "self_attn.q_b_proj.weight": 0,
    "self_attn.kv_a_proj_with_mqa.weight": None,
    "self_attn.kv_a_layernorm.weight": None,
    "self_attn.kv_b_proj.weight": 0,
    "mlp.gate.e_score_correction_bias": None,
    "mlp.shared_experts.gate_proj.weight": 0,
    "mlp.shared_experts.up_proj.weight": 0,
    "mlp.shared_experts.down_proj.weight": 1,
}
_TABLE: dict[str, int | None] = {
    **{hf: r.partition_dim for r in (*LAYER_RULES, *MODEL_RULES, *ROUTER_RULES) for hf in r.hf},
    **{hf.removeprefix("mlp.experts.{e}."): r.partition_dim for r in EXPERT_RULES for hf in r.hf},
    **EXTRA_TP_DIMS,
}
_LAYER = re.compile(r"model\.layers\.\d+\.(?:mlp\.experts\.\d+\.)?(.+)")
_REPLICATE = Placement(kind="replicate")
_PLACEMENTS = {d: (_REPLICATE, _REPLICATE if d is None else Placement(kind="shard", dim=d))
               for d in (None, 0, 1)}


def tp_dim(name: str, *, where: str) -> int | None:
    """The dim Megatron cuts Hugging Face parameter ``name`` on over (expert) TP, or None;
    ValueError naming it if no table knows it."""
    m = _LAYER.fullmatch(name)
    key = m.group(1) if m else name
    if key not in _TABLE:
        raise ValueError(f"{where}: parameter {name!r} has no Megatron TP rule (the tables of "
                         "weight_transfer.model.arch.megatron_gpt and megatron_moe, and "
                         "scheduling.megatron_metadata.EXTRA_TP_DIMS)")
    return _TABLE[key]


def megatron_trainer_meta(cfg: ModelConfig, cluster: ClusterConfig, *,
                          expert_naming: str = "per_expert") -> TrainerMeta:
    """Every Hugging Face parameter of ``cfg`` on the meshes of the cluster's Megatron
    layout (module docstring); ValueError naming the cluster file and the field if the
    layout does not fit the model."""
    m = cluster.trainer.megatron
    assert m is not None, "megatron_trainer_meta needs trainer.megatron"
    model = cfg.name or cfg.architecture
    where = f"cluster {cluster.source or cluster.name!r} with model {model!r}"
    if expert_naming != "per_expert":
        raise ValueError(f"{where}: expert naming {expert_naming!r} is an FSDP trainer's; a "
                         "Megatron trainer's experts are per expert")
    world = cluster.trainer_world
    n_experts = cfg.n_experts
    check_experts(m, n_experts, where=where)
    stages = layer_stages(m, cfg.num_hidden_layers, where=where)
    last = m.pipeline_parallel - 1
    dense = [dense_mesh(m, world, p) for p in range(m.pipeline_parallel)]
    per_rank = n_experts // m.expert_parallel if n_experts else 1
    experts: dict[tuple[int, int], MeshDesc] = {}

    def mesh(spec) -> MeshDesc:
        if spec.layer is None:
            return dense[0 if spec.name.startswith("model.embed_tokens.") else last]
        stage = stages[spec.layer] if spec.layer < len(stages) else last  # MTP: the last
        if spec.expert is None:
            return dense[stage]
        key = (stage, spec.expert // per_rank)
        if key not in experts:
            experts[key] = expert_mesh(m, world, *key)
        return experts[key]

    params = tuple(
        ParamMeta(name=spec.name, shape=spec.shape, dtype=spec.dtype, mesh=mesh(spec),
                  placements=_PLACEMENTS[tp_dim(spec.name, where=where)])
        for spec in trainer_param_specs(cfg, expert_naming="per_expert"))
    return TrainerMeta(params=params, ranks=cluster.rank_infos())
