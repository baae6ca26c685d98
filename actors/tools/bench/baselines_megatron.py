"""slime's own weight sync on Megatron-core trainers (``wt bench designs --trainer
megatron``'s ``native``): what every baseline gathers from a Megatron ``GPTModel``.

slime's ``update_weight`` walks the parameters; each is all-gathered over its TP group
(an expert's over expert TP), the Megatron tensor converted to Hugging Face tensors
(grouped QKV into q, k and v; ``linear_fc1`` into gate and up; the padded vocabulary
dropped), and trainer rank 0 broadcasts each to the engines, which load it
(:func:`actors.tools.bench.baselines.trainer_rank0`). The conversion is the test kit's
plain one (:mod:`actors.tools.testkit.megatron_hf`). PP 1 only: slime's PP broadcast
(each stage's tensors to rank 0) is not run here, and a model with pipeline stages is
refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from weight_transfer.model.naming import canonical_trainer_name


def megatron_model(model: Any) -> bool:
    from weight_transfer.sources.megatron import is_gpt_model

    return is_gpt_model(model)


def _check_one_stage(model: Any, rank: int) -> None:
    if model.config.pipeline_model_parallel_size != 1:
        raise ValueError(f"trainer rank {rank}: the Megatron baselines run at PP 1 (slime's "
                         f"PP broadcast is not implemented); this model has PP "
                         f"{model.config.pipeline_model_parallel_size}")


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

    _check_one_stage(model, rank)
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
