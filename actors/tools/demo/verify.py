"""The checks of one demo update, run against the live fleet (:func:`verify`).

Digests are computed inside the actors (``actor.__ray_call__``), so no weights
cross Ray's object store: the engine tensors' digests against the reference
layout of the trainer's current weights (:func:`check_bytes`; the vLLM engine
has its own in :mod:`actors.tools.demo.vllm_demo`), that some tensor changed since the
previous version, greedy generations (bf16) or logits (FP8) against the
trainer model's, and every replica at the version. The pure comparisons are in
:mod:`actors.tools.demo.checks`::

    checks, problems, digests = verify(fleet, version, prompts, previous)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray
import torch

from actors.tools.demo.checks import (
    byte_problems,
    expected_digests,
    logits_problems,
    tensor_digests,
    token_problems,
)
from actors.tools.demo.fleet_handle import Fleet
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.types import EngineRankId

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------ inside the actors
# Run by ``actor.__ray_call__`` in the actor's process: only digests come back.


def _trainer_digests(trainer: Any, shards: dict[str, Any], fp8: bool) -> dict | None:
    """On every trainer rank (a collective); rank 0 returns the reference digests."""
    state = trainer.full_state_dict()
    return None if state is None else expected_digests(trainer.config.model, state, shards,
                                                       fp8=fp8)


def _engine_digests(engine: Any) -> dict[str, str]:
    return tensor_digests(engine.engine_state_bytes())


def _flip_byte(engine: Any, name: str, index: int) -> None:
    """Test hook: corrupt one byte of one engine tensor in place."""
    as_bytes(engine.engine.tensors[name])[index] ^= 0xFF


def corrupt_one_byte(fleet: Fleet, version: int) -> None:
    """Flip one byte of the first replica's qkv weight of layer 0 (the checks must catch it)."""
    name = "model.layers.0.self_attn.qkv_proj.weight"
    engine0 = next(iter(fleet.replicas.values()))[0]
    ray.get(engine0.__ray_call__.remote(_flip_byte, name, 100))
    log.warning("test hook: flipped byte 100 of %s on the first engine after version %d",
                name, version)


def first_answer(values: list) -> Any:
    """The one non-None answer of a collective (trainer rank 0's)."""
    return next(v for v in values if v is not None)


def _equal(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _on_replicas(fleet: Fleet, method: str, *args: Any, problems: list[str]) -> dict[str, Any]:
    """Call ``method`` on every TP rank of each replica together; the ranks must agree."""
    out = {}
    for name, actors in fleet.replicas.items():
        values = ray.get([getattr(a, method).remote(*args) for a in actors])
        if any(not _equal(v, values[0]) for v in values[1:]):
            problems.append(f"{name}: TP ranks returned different {method} results")
        out[name] = values[0]
    return out


def _on_trainers(fleet: Fleet, method: str, *args: Any) -> Any:
    """Call ``method`` on every trainer rank (a collective); rank 0's answer."""
    return first_answer(ray.get([getattr(t, method).remote(*args) for t in fleet.trainers]))


def check_bytes(fleet: Fleet, checks: dict, problems: list[str],
                previous: dict | None) -> dict[str, dict[str, str]]:
    """Engine digests against the reference layout; returns them for the next update."""
    want = first_answer(ray.get([t.__ray_call__.remote(_trainer_digests, fleet.engine_keys,
                                                 fleet.config.engine_fp8)
                           for t in fleet.trainers]))
    got = {str(EngineRankId(replica=name, rank=r)): d for name, actors in fleet.replicas.items()
           for r, d in enumerate(ray.get([a.__ray_call__.remote(_engine_digests)
                                          for a in actors]))}
    issues = byte_problems(want, got)
    checks.update(bytes=not issues, tensors=sum(len(d) for d in got.values()),
                  oracle="weight_transfer.engines.reference.loader")
    problems += issues
    check_changed(got, previous, checks, problems)
    return got


def check_changed(got: dict[str, dict[str, str]], previous: dict | None, checks: dict,
                  problems: list[str]) -> None:
    """How many engine tensors' digests changed since the previous update (some must)."""
    if previous is not None:
        changed = sum(got[k][n] != previous.get(k, {}).get(n) for k in got for n in got[k])
        checks["tensors_changed_since_previous"] = changed
        if changed == 0:
            problems.append("no engine tensor changed since the previous version "
                            "(the train step did not change the weights)")


def check_outputs(fleet: Fleet, prompts: list[list[int]], checks: dict,
                  problems: list[str]) -> None:
    """bf16: greedy tokens equal the trainer model's; FP8: logits within the tolerance."""
    verify_cfg = fleet.run.verify
    if not fleet.config.engine_fp8:
        n = verify_cfg.max_new_tokens
        want = _on_trainers(fleet, "reference_generate", prompts, n)
        issues = token_problems(want, _on_replicas(fleet, "generate", prompts, n,
                                                   problems=problems))
        checks.update(generations=not issues, generation_sample=want[0])
    else:
        want = _on_trainers(fleet, "reference_logits", prompts)
        got = _on_replicas(fleet, "logits", prompts, problems=problems)
        worst, issues = logits_problems(want, got, rel_tol=verify_cfg.fp8_logits_rel_tol)
        checks.update(logits=not issues, logits_rel_error=worst,
                      logits_rel_tol=verify_cfg.fp8_logits_rel_tol)
    problems += issues


def verify(fleet: Fleet, version: int, prompts: list[list[int]],
           previous: dict[str, dict[str, str]] | None, *,
           check_bytes: Callable = check_bytes) -> tuple[dict, list[str], dict]:
    """Checks of one update: (checks, problems, engine digests for the next update).

    ``check_bytes`` is the engine's byte check (the reference engine's by default).
    """
    checks: dict[str, Any] = {}
    problems: list[str] = []
    digests = check_bytes(fleet, checks, problems, previous)
    versions = fleet.controller.weights_version()
    checks["weights_version"] = versions
    problems += [f"{name}: holds version {v}, expected {version}"
                 for name, v in versions.items() if v != version]
    check_outputs(fleet, prompts, checks, problems)
    return checks, problems, digests
