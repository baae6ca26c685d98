"""slime's own weight sync on Megatron-core trainers (``wt bench designs --trainer
megatron``'s ``native``): what every baseline gathers from a Megatron ``GPTModel``.

slime's ``update_weight`` walks the parameters; each is all-gathered over its TP group
(an expert's over expert TP), the Megatron tensor converted to Hugging Face tensors
(grouped QKV into q, k and v; ``linear_fc1`` into gate and up; the padded vocabulary
dropped), and trainer rank 0 broadcasts each to the engines, which load it
(:func:`actors.tools.bench.baselines.trainer_rank0`). The conversion is the test kit's
plain one (:mod:`actors.tools.testkit.megatron_hf`). PP 1 and EP 1 only, and refused
otherwise: under PP slime makes each stage's DP 0, TP 0 rank a source of its own, in a
broadcast group of its own with every engine rank (``slime-pp_{pp_rank}``), after an
all-gather of the experts over EP; here one group joins trainer rank 0 and the engines,
and rank 0 holds only its own stage and its own EP rank's experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from weight_transfer.model.naming import canonical_trainer_name


def megatron_model(model: Any) -> bool:
    from weight_transfer.sources.megatron import is_gpt_model

    return is_gpt_model(model)


def _check_one_source(model: Any, rank: int) -> None:
    """ValueError unless trainer rank 0 holds every parameter once gathered over TP."""
    cfg = model.config
    for what, size in (("PP", cfg.pipeline_model_parallel_size),
                       ("EP", getattr(cfg, "expert_model_parallel_size", 1) or 1)):
        if size != 1:
            raise ValueError(f"trainer rank {rank}: the Megatron baselines run at PP 1 and "
                             f"EP 1 (one broadcast group, from trainer rank 0; slime's group "
                             f"per pipeline stage is not implemented); this model has "
                             f"{what} {size}")


def _converted(model: Any, vocab: int, full: Any) -> Iterator[tuple[str, torch.Tensor]]:
    from actors.tools.testkit.megatron_hf import (
        first_expert,
        hf_tensors,
        model_dims,
        stage_layers,
    )

    layers, first, dims = stage_layers(model), first_expert(model), model_dims(model, vocab)
    for name, p in model.named_parameters():
        for hf_name, t in hf_tensors(name, full(name, p), layers=layers, first_expert=first,
                                     dims=dims):
            yield canonical_trainer_name(hf_name), t


def gathered(model: Any, vocab: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, full Hugging Face tensor) in order: per parameter a TP all-gather
    and the split (a collective over each TP group)."""
    from actors.tools.testkit.megatron_hf import tp_full

    _check_one_source(model, rank)
    for name, t in _converted(model, vocab, tp_full):
        yield name, t.contiguous()


def params(model: Any, vocab: int) -> list[tuple[str, tuple[int, ...], str, int]]:
    """What :func:`gathered` yields, ``(name, shape, dtype, nbytes)``, with no collective
    (the split run on meta tensors of the gathered shapes)."""
    from actors.tools.testkit.megatron_hf import full_shape

    def meta(name: str, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(full_shape(name, p), dtype=p.dtype, device="meta")

    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch."),
             t.numel() * t.element_size()) for n, t in _converted(model, vocab, meta)]
