"""What the demo checks after every update, and how it reports it (pure: no Ray).

The checks compare what the engines hold and compute with an independent
reference built from the trainer's current weights (a full Hugging Face state
dict):

* bytes - every engine tensor equals, byte for byte, what the reference loader
  (``weight_transfer.engines.reference.loader.load_engine_shard``) lays out for that
  engine's shard: plain bf16 copies, or for FP8 engines the reference 128x128
  block quantization (e4m3 values and float32 ``weight_scale_inv``). Compared
  by sha256 per tensor, so only digests cross processes;
* generations (bf16 engines) - each replica's greedy continuations equal the
  trainer model's (transformers, float32), token for token;
* logits (FP8 engines) - quantization changes the numbers, so each replica's
  logits on the prompts must be within ``rel_tol`` of the trainer model's:
  ``max |engine - trainer| / max |trainer|`` over every position and token.

:func:`UpdateCheck` collects one update's numbers and problems;
:func:`render_table` and :func:`write_json` report them::

    problems = byte_problems(expected_digests(cfg, state, shards, fp8=False), got)
    problems += token_problems(want_tokens, {"replica0": tokens0, ...})
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.model.models import ModelConfig
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.types import ShardSpec

STAGES = ("h2d", "prepare", "write", "barrier")
MAX_PROBLEMS = 20  # per check; the rest are counted


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes (any dtype, FP8 included)."""
    return {n: hashlib.sha256(as_bytes(t).numpy()).hexdigest() for n, t in tensors.items()}


def expected_digests(
    cfg: ModelConfig, state: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec],
    *, fp8: bool,
) -> dict[str, dict[str, str]]:
    """Per engine rank (keyed like ``shards``), the digests the reference loader implies."""
    cache: dict[ShardSpec, dict[str, str]] = {}
    out = {}
    for key, shard in shards.items():
        if shard not in cache:  # replicas share shards: quantize each shard once
            cache[shard] = tensor_digests(load_engine_shard(cfg, dict(state), shard, fp8=fp8))
        out[key] = cache[shard]
    return out


def capped(problems: list[str]) -> list[str]:
    if len(problems) <= MAX_PROBLEMS:
        return problems
    return [*problems[:MAX_PROBLEMS], f"... and {len(problems) - MAX_PROBLEMS} more"]


def byte_problems(
    want: Mapping[str, Mapping[str, str]], got: Mapping[str, Mapping[str, str]]
) -> list[str]:
    """One line per engine rank/tensor whose digest differs, is missing or unexpected."""
    problems = []
    for key in sorted(set(want) | set(got)):
        if key not in got:
            problems.append(f"{key}: engine rank did not report its tensors")
            continue
        if key not in want:
            problems.append(f"{key}: engine rank not in the cluster layout")
            continue
        w, g = want[key], got[key]
        problems += [f"{key}: tensor {n} missing on the engine" for n in sorted(set(w) - set(g))]
        problems += [f"{key}: unexpected tensor {n}" for n in sorted(set(g) - set(w))]
        problems += [
            f"{key}: tensor {n} bytes differ from the reference layout"
            for n in sorted(set(w) & set(g)) if w[n] != g[n]
        ]
    return capped(problems)


def token_problems(
    want: Sequence[Sequence[int]], got: Mapping[str, Sequence[Sequence[int]]]
) -> list[str]:
    """One line per replica and prompt whose greedy tokens differ from the trainer's."""
    problems = []
    for replica in sorted(got):
        tokens = got[replica]
        if len(tokens) != len(want):
            problems.append(f"{replica}: {len(tokens)} generations for {len(want)} prompts")
            continue
        for i, (w, g) in enumerate(zip(want, tokens, strict=True)):
            if list(w) != list(g):
                at = next((j for j, (a, b) in enumerate(zip(w, g, strict=False)) if a != b),
                          min(len(w), len(g)))
                problems.append(f"{replica}: prompt {i} differs at new token {at}: "
                                f"trainer {list(w)} engine {list(g)}")
    return capped(problems)


def logits_rel_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (float32); ValueError on a shape mismatch."""
    if tuple(want.shape) != tuple(got.shape):
        raise ValueError(f"logits shapes differ: trainer {tuple(want.shape)}, "
                         f"engine {tuple(got.shape)}")
    want, got = want.float(), got.float()
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / scale if scale > 0 else float("inf")


def logits_problems(
    want: torch.Tensor, got: Mapping[str, torch.Tensor], *, rel_tol: float
) -> tuple[float, list[str]]:
    """The worst relative error over replicas, and one line per replica over ``rel_tol``."""
    worst, problems = 0.0, []
    for replica in sorted(got):
        try:
            err = logits_rel_error(want, got[replica])
        except ValueError as exc:
            problems.append(f"{replica}: {exc}")
            continue
        worst = max(worst, err)
        if not err <= rel_tol:
            problems.append(f"{replica}: logits relative error {err:.4f} > tolerance {rel_tol}")
    return worst, problems


@dataclass(slots=True, kw_only=True)
class UpdateCheck:
    """One update: the controller's numbers and the verdict of every check."""

    version: int
    seconds: float
    bytes: int
    stages: dict[str, float]
    checks: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return bool(self.checks) and not self.problems

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "gb_per_s": self.gb_per_s,
            "stages": {s: self.stages.get(s, 0.0) for s in STAGES},
            "verified": self.verified,
            "checks": self.checks,
            "problems": list(self.problems),
            "report": self.report,
        }


def render_table(rows: Sequence[UpdateCheck], *, title: str) -> Table:
    """A rich table: one row per update with bytes, GB/s, stage times and the verdict."""
    table = Table(title=title, caption="seconds; stages: busy time of the slowest rank",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1),
                  collapse_padding=True)
    for col in ("version", "seconds", "MB", "GB/s", *STAGES, "verified"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    for r in rows:
        verdict = "[green]yes[/]" if r.verified else "[bold red]NO[/]"
        table.add_row(str(r.version), f"{r.seconds:.3f}", f"{r.bytes / 1e6:.2f}",
                      f"{r.gb_per_s:.3f}", *(f"{r.stages.get(s, 0.0):.3f}" for s in STAGES),
                      verdict)
    return table


def make_console() -> Console:
    """Rich console; 120 columns when the output is a log, not a terminal (job logs)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def summary(rows: Sequence[UpdateCheck], **info: Any) -> dict[str, Any]:
    """The JSON document: run info, every update, and ``verified`` over all of them."""
    return {**info, "verified": bool(rows) and all(r.verified for r in rows),
            "updates": [r.as_dict() for r in rows]}


def write_json(path: Path, rows: Sequence[UpdateCheck], **info: Any) -> dict[str, Any]:
    """Write :func:`summary` to ``path`` (parents created) and return it."""
    doc = summary(rows, **info)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return doc
