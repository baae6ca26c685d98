"""Seeded random trainer weights of a tiny model config, for the demo and the tests.

The same seed gives the same weights in every process, so each trainer rank and
every oracle can build the model's state on its own::

    state = random_state_dict(cfg, seed=3, expert_naming="stacked")
"""

from __future__ import annotations

import math

import torch

from weight_transfer.model.models import ModelConfig, trainer_param_specs

# Guards against seeding a real model (Kimi-K2) by mistake; configs/models/bench_dense.yaml
# (286 M, the 0.57 GB model of `wt bench designs`) is the largest meant to be seeded.
RANDOM_STATE_MAX_ELEMENTS = 300_000_000


def random_state_dict(
    cfg: ModelConfig,
    *,
    seed: int,
    expert_naming: str = "per_expert",
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Seeded random trainer parameters of a tiny config (ValueError on a big one).

    Norm weights are near 1, other weights ~N(0, 0.02); float32 specs (the
    router bias) stay float32, everything else gets ``dtype``.
    """
    specs = trainer_param_specs(cfg, expert_naming=expert_naming)
    total = sum(math.prod(s.shape) for s in specs)
    if total > RANDOM_STATE_MAX_ELEMENTS:
        raise ValueError(
            f"random_state_dict: {cfg.name or cfg.architecture} has {total:,} parameters; "
            f"only tiny configs (<= {RANDOM_STATE_MAX_ELEMENTS:,}) are allowed"
        )
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for s in specs:
        t = torch.randn(s.shape, generator=gen, dtype=torch.float32)
        t = 1.0 + 0.1 * t if s.name.endswith("norm.weight") else 0.02 * t
        out[s.name] = t.to(getattr(torch, s.dtype) if s.dtype == "float32" else dtype)
    return out
