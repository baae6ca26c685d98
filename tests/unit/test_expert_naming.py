"""``expert_naming_of``: the trainer's expert naming, from parameter names alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_transfer.model.live_metadata import expert_naming_of


def _model(*names: str) -> nn.Module:
    """A module tree holding one small parameter at each dotted ``name``."""
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.zeros(2)))
    return root


@pytest.mark.parametrize("names, want", [
    (("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"),
     "stacked"),
    (("model.layers.0.mlp.experts.0.gate_proj.weight",
      "model.layers.0.mlp.experts.0.up_proj.weight"), "per_expert"),
    (("model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight"), "per_expert"),
    (("_orig_mod.model.layers.3.mlp.experts.gate_up_proj",), "stacked"),  # wrapper prefix
])
def test_naming_follows_the_parameter_names(names, want):
    assert expert_naming_of(_model(*names)) == want
