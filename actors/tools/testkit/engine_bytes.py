"""The reference engines' bytes against the reference loader's layout of the trainer's weights.

For the integration tests: after an update every engine tensor of every replica must
equal :func:`weight_transfer.engines.reference.loader.load_engine_shard` of the
trainers' full state dict::

    assert engine_mismatches(cfg.model, trainers, replicas) == []
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.sender.prepare import as_bytes


def full_state(trainers: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Trainer rank 0's full state dict (a collective on every rank)."""
    return ray.get([t.full_state_dict.remote() for t in trainers])[0]


def engine_mismatches(model: Any, trainers: Sequence[Any], replicas: Sequence[Sequence[Any]],
                      *, fp8: bool = False, state: Mapping[str, torch.Tensor] | None = None
                      ) -> list[tuple[str, int, str]]:
    """(replica, rank, tensor) of every engine tensor whose bytes differ from the reference
    layout of ``state`` (None: the trainers' :func:`full_state`); a rank holding other
    tensor names than the layout fails an assertion."""
    state, bad = full_state(trainers) if state is None else state, []
    for rep in replicas:
        for actor in rep:
            meta = ray.get(actor.wt_engine_meta.remote())
            got = ray.get(actor.engine_state_bytes.remote())
            want = load_engine_shard(model, state, meta.shard, fp8=fp8)
            assert set(got) == set(want), (meta.replica, meta.rank, set(got) ^ set(want))
            bad += [(meta.replica, meta.rank, n) for n in want
                    if not torch.equal(got[n], as_bytes(want[n]).reshape(-1))]
    return bad
