"""A Megatron trainer's layout in a cluster YAML: TP, PP, EP, expert TP and virtual stages.

``trainer.megatron`` says how a Megatron-core trainer spreads the model over the
trainer ranks, in Megatron's rank order (TP innermost, then data parallel, then
pipeline stages outermost; inside a stage, experts in the order expert TP, EP,
expert data parallel)::

    trainer:
      nodes: 32
      gpus_per_node: 8
      nics_per_node: 8
      nic_gbps: 400
      megatron:
        tensor_parallel: 8
        pipeline_parallel: 8
        expert_parallel: 32
        expert_tensor_parallel: 1   # default 1
        virtual_pipeline: 1         # default 1
        stage_layers: [8, 8, ...]   # optional: layers per virtual stage (uneven split)

Data parallel (and context parallel, which holds the same weights) is what is left:
``world / (tensor_parallel * pipeline_parallel)``. Stage ``p`` holds ranks
``p * S .. p * S + S - 1`` (``S = world / pipeline_parallel``); its dense
parameters sit on the ``(dp, tp)`` mesh :func:`dense_mesh`, its experts on the
``(edp, etp)`` meshes :func:`expert_mesh` of each EP rank (EP rank ``e`` holds
experts ``e * E/ep .. (e+1) * E/ep - 1``, the same in every stage).

Virtual stage ``v * pipeline_parallel + p`` is chunk ``v`` of stage ``p``; layers go
to virtual stages in that order, evenly, or as ``stage_layers`` says (Megatron's
uneven first and last stages, or its ``pipeline-model-parallel-layout``).
The layout alone is checked when the file is read; against a model (EP divides the
experts, the layers split over the virtual stages) by :func:`layer_stages` and
:func:`check_experts`, whose errors name the file, the field and the value.
Pure: no torch, no megatron.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from weight_transfer.config_files import FieldError, StrictModel
from weight_transfer.types import MeshDesc

__all__ = ["FLAG_KEYS", "MegatronLayout", "check_experts", "check_world", "dense_mesh",
           "expert_mesh", "layer_stages", "parse_flag"]

# ``--megatron tp=8,pp=8,ep=32,etp=1,vpp=1,layers=7:8:8:8:8:8:8:6`` -> the YAML's fields
FLAG_KEYS = {"tp": "tensor_parallel", "pp": "pipeline_parallel", "ep": "expert_parallel",
             "etp": "expert_tensor_parallel", "vpp": "virtual_pipeline",
             "layers": "stage_layers"}


class MegatronLayout(StrictModel):
    """``trainer.megatron``: see the module docstring."""

    tensor_parallel: int = Field(ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    expert_parallel: int = Field(default=1, ge=1)
    expert_tensor_parallel: int = Field(default=1, ge=1)
    virtual_pipeline: int = Field(
        default=1, ge=1, description="model chunks per pipeline stage (interleaved schedule)")
    stage_layers: tuple[int, ...] | None = Field(
        default=None,
        description="layers per virtual stage, in the order chunk 0 of every stage, then "
                    "chunk 1 ... (None: the layers split evenly)")

    @model_validator(mode="after")
    def _check(self) -> MegatronLayout:
        chunks = self.pipeline_parallel * self.virtual_pipeline
        if self.stage_layers is not None:
            if len(self.stage_layers) != chunks:
                raise FieldError(
                    f"stage_layers has {len(self.stage_layers)} entries, pipeline_parallel "
                    f"x virtual_pipeline = {self.pipeline_parallel} x "
                    f"{self.virtual_pipeline} = {chunks} virtual stages need one each")
            if any(n < 0 for n in self.stage_layers):
                raise FieldError(f"stage_layers holds a negative count: {self.stage_layers}")
        return self

    @property
    def virtual_stages(self) -> int:
        return self.pipeline_parallel * self.virtual_pipeline


def parse_flag(text: str) -> dict[str, object]:
    """The ``trainer.megatron`` mapping a ``--megatron`` flag says (:data:`FLAG_KEYS`;
    ``layers`` separated by ``:``); ValueError naming the flag and the bad item."""
    out: dict[str, object] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in FLAG_KEYS:
            raise ValueError(f"--megatron {text!r}: {item!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(FLAG_KEYS)}")
        try:
            out[FLAG_KEYS[key]] = ([int(n) for n in value.split(":")] if key == "layers"
                                   else int(value))
        except ValueError:
            raise ValueError(f"--megatron {text!r}: {key}={value!r} is not "
                             f"{'integers separated by :' if key == 'layers' else 'an integer'}"
                             ) from None
    if "tensor_parallel" not in out:
        raise ValueError(f"--megatron {text!r}: tp=N is missing")
    return out


def check_world(m: MegatronLayout, world: int) -> str | None:
    """Why ``m`` does not fit ``world`` trainer ranks (a message naming the field), or None."""
    tp, pp = m.tensor_parallel, m.pipeline_parallel
    if world % (tp * pp):
        return (f"megatron.tensor_parallel x pipeline_parallel = {tp} x {pp} = {tp * pp} "
                f"does not divide the {world} trainer ranks (tp x pp x dp must equal them)")
    stage = world // pp
    ep, etp = m.expert_parallel, m.expert_tensor_parallel
    if stage % (ep * etp):
        return (f"megatron.expert_parallel x expert_tensor_parallel = {ep} x {etp} = "
                f"{ep * etp} does not divide a pipeline stage's {stage} ranks "
                f"({world} ranks / pipeline_parallel {pp})")
    return None


def _stage_base(m: MegatronLayout, world: int, stage: int) -> int:
    return stage * (world // m.pipeline_parallel)


def dense_mesh(m: MegatronLayout, world: int, stage: int) -> MeshDesc:
    """The ``(dp, tp)`` mesh of pipeline stage ``stage``: rank ``base + d * tp + t``."""
    tp = m.tensor_parallel
    dp = world // (tp * m.pipeline_parallel)
    base = _stage_base(m, world, stage)
    return MeshDesc(ranks=tuple(range(base, base + dp * tp)), shape=(dp, tp),
                    dim_names=("dp", "tp"))


def expert_mesh(m: MegatronLayout, world: int, stage: int, ep_rank: int) -> MeshDesc:
    """The ``(edp, etp)`` mesh of EP rank ``ep_rank`` in stage ``stage``: rank
    ``base + (d * ep + ep_rank) * etp + t``."""
    ep, etp = m.expert_parallel, m.expert_tensor_parallel
    edp = world // m.pipeline_parallel // (ep * etp)
    base = _stage_base(m, world, stage)
    ranks = tuple(base + (d * ep + ep_rank) * etp + t for d in range(edp) for t in range(etp))
    # dim names as the live source's (weight_transfer.sources.megatron_layout.stage_mesh)
    return MeshDesc(ranks=ranks, shape=(edp, etp), dim_names=("dp", "tp"))


def layer_stages(m: MegatronLayout, layers: int, *, where: str) -> tuple[int, ...]:
    """The pipeline stage of each of the model's ``layers`` layers; ValueError (naming
    ``where``, the field and the value) if they do not split over the virtual stages."""
    chunks = m.virtual_stages
    counts = m.stage_layers
    if counts is None:
        if layers % chunks:
            raise ValueError(
                f"{where}: the model's {layers} layers do not split evenly over "
                f"trainer.megatron pipeline_parallel x virtual_pipeline = "
                f"{m.pipeline_parallel} x {m.virtual_pipeline} = {chunks} virtual stages; "
                "set trainer.megatron.stage_layers (layers per virtual stage)")
        counts = (layers // chunks,) * chunks
    elif sum(counts) != layers:
        raise ValueError(f"{where}: trainer.megatron.stage_layers sums to {sum(counts)}, "
                         f"the model has {layers} layers")
    return tuple(v % m.pipeline_parallel for v, n in enumerate(counts) for _ in range(n))


def check_experts(m: MegatronLayout, experts: int, *, where: str) -> None:
    """ValueError (naming ``where``) unless EP splits the model's ``experts`` evenly."""
    if experts and experts % m.expert_parallel:
        raise ValueError(f"{where}: trainer.megatron.expert_parallel={m.expert_parallel} "
                         f"does not divide the model's {experts} experts")
