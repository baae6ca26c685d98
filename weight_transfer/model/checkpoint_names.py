"""Checkpoint names -> trainer names, for layouts recorded in checkpoint terms.

An engine's loader (vLLM's ``load_weights``) speaks the checkpoint's names:
per-expert tensors such as ``model.layers.3.mlp.experts.7.gate_proj.weight``.
Trainers built with transformers 5 hold experts stacked in 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2*I, H], gate rows first;
``mlp.experts.down_proj`` [E, H, I]). This table rewrites a recorded piece
onto the parameter the trainer holds::

    to_trainer_pieces(pieces, {"model.layers.3.mlp.experts.gate_up_proj": (8, 512, 256), ...})

A checkpoint name that is itself a trainer parameter is kept. Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from weight_transfer.types import Piece

# (checkpoint pattern, stacked trainer parameter, part along dim 1 of 2 or None: whole)
STACKED_EXPERTS: tuple[tuple[re.Pattern, str, int | None], ...] = (
    (re.compile(r"^(?P<p>.+\.experts)\.(?P<e>\d+)\.gate_proj\.weight$"), "{p}.gate_up_proj", 0),
    (re.compile(r"^(?P<p>.+\.experts)\.(?P<e>\d+)\.up_proj\.weight$"), "{p}.gate_up_proj", 1),
    (re.compile(r"^(?P<p>.+\.experts)\.(?P<e>\d+)\.down_proj\.weight$"), "{p}.down_proj", None),
)


def trainer_source(name: str, rect: tuple, shapes: Mapping[str, tuple[int, ...]]
                   ) -> tuple[str, tuple] | None:
    """The trainer parameter and rectangle holding checkpoint ``name``'s ``rect``; None if
    no trainer parameter does."""
    if name in shapes:
        return name, rect
    for pattern, target, part in STACKED_EXPERTS:
        m = pattern.match(name)
        if m is None:
            continue
        stacked = target.format(p=m["p"])
        shape = shapes.get(stacked)
        if shape is None or len(shape) != 3:
            return None
        e, off = int(m["e"]), 0 if part is None else part * (shape[1] // 2)
        (r0, r1), *rest = rect
        return stacked, ((e, e + 1), (r0 + off, r1 + off), *rest)
    return None


def to_trainer_pieces(pieces: Iterable[Piece], shapes: Mapping[str, tuple[int, ...]]
                      ) -> tuple[list[Piece], list[str]]:
    """Pieces renamed onto trainer parameters, and the checkpoint names no trainer
    parameter holds (each once)."""
    out, missing = [], {}
    for p in pieces:
        hit = trainer_source(p.src_param, p.src_slice, shapes)
        if hit is None:
            missing[p.src_param] = None
            continue
        name, rect = hit
        out.append(p if (name, rect) == (p.src_param, p.src_slice)
                   else dataclasses.replace(p, src_param=name, src_slice=rect))
    return out, list(missing)
