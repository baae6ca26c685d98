"""Version-tagged generations: which weight version(s) produced each output token.

An engine records the version it holds at every engine step; a sequence that
an update overtook mid-request carries several spans. vLLM reports its own
per-span ``weight_versions`` (strings, :func:`from_vllm` converts them); the
reference engine records the same shape per step (:class:`VersionRecorder`)::

    gen = Generation(tokens=(5, 9, 2), spans=(VersionSpan(version=3, start=0),
                                              VersionSpan(version=4, start=2)))
    gen.versions           # (3, 4)
    gen.oldest             # 3: the oldest version that produced a token
    gen.lag(current=5)     # 2: versions behind the trainers' current one
    kept, dropped = fresh(gens, current=5, max_lag=1)   # RL: drop stale samples

A span's version is what the engine reported (an int for our controller's
versions; None where the engine held none, a torn or unknown version). A
generation with a None span has no known lag and is never counted fresh.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionSpan:
    """Output tokens from index ``start`` (up to the next span's start) came from weights of
    ``version``."""

    version: int | None
    start: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """One generated sequence: its new tokens and the version spans over them (in order,
    starts strictly increasing, the first at 0)."""

    tokens: tuple[int, ...]
    spans: tuple[VersionSpan, ...]

    def __post_init__(self) -> None:
        starts = [s.start for s in self.spans]
        if self.tokens and (not starts or starts[0] != 0):
            raise ValueError(f"version spans must start at token 0, got starts {starts}")
        if any(b <= a for a, b in itertools.pairwise(starts)) or any(
                s >= len(self.tokens) for s in starts[1:]):
            raise ValueError(f"version span starts {starts} must increase and stay below "
                             f"{len(self.tokens)} tokens")

    @property
    def versions(self) -> tuple[int | None, ...]:
        return tuple(s.version for s in self.spans)

    @property
    def oldest(self) -> int | None:
        """The oldest version that produced a token; None when a span's version is unknown
        (or there are no tokens)."""
        vs = self.versions
        return None if not vs or None in vs else min(vs)

    def lag(self, current: int) -> int | None:
        """How many versions behind ``current`` the oldest token is (None: unknown)."""
        oldest = self.oldest
        return None if oldest is None else current - oldest

    def span_ends(self) -> list[tuple[int | None, int, int]]:
        """(version, start, end) of every span, ends exclusive."""
        ends = [s.start for s in self.spans[1:]] + [len(self.tokens)]
        return [(s.version, s.start, e) for s, e in zip(self.spans, ends, strict=True)]


def parse_version(label: Any) -> int | None:
    """An engine's version label as our controller's version: ints stay, decimal strings
    become ints, anything else (vLLM's ``"default"``, ``"none"``, None) is None."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        return int(label)
    return None


def from_vllm(token_ids: Sequence[int], weight_versions: Iterable[Any] | None) -> Generation:
    """A :class:`Generation` from a vLLM completion's ``token_ids`` and ``weight_versions``
    (``WeightVersionSpan(version, start, end)``; None when vLLM reported no version)."""
    tokens = tuple(int(t) for t in token_ids)
    spans = tuple(VersionSpan(version=parse_version(s.version), start=int(s.start))
                  for s in (weight_versions or ()) if s.end > s.start)
    if tokens and not spans:
        spans = (VersionSpan(version=None, start=0),)
    return Generation(tokens=tokens, spans=_merged(spans))


def _merged(spans: Iterable[VersionSpan]) -> tuple[VersionSpan, ...]:
    out: list[VersionSpan] = []
    for s in spans:
        if not out or out[-1].version != s.version:
            out.append(s)
    return tuple(out)


class VersionRecorder:
    """Spans of one batch of sequences, recorded step by step (the reference engine): call
    :meth:`step` with the version held when each step's token is produced."""

    def __init__(self, batch: int) -> None:
        self._starts: list[list[VersionSpan]] = [[] for _ in range(batch)]
        self._count = 0

    def step(self, version: Any) -> None:
        v = parse_version(version)
        for starts in self._starts:
            if not starts or starts[-1].version != v:
                starts.append(VersionSpan(version=v, start=self._count))
        self._count += 1

    def generations(self, tokens: Sequence[Sequence[int]]) -> list[Generation]:
        return [Generation(tokens=tuple(int(t) for t in toks), spans=tuple(starts))
                for toks, starts in zip(tokens, self._starts, strict=True)]


def fresh(generations: Sequence[Generation], *, current: int, max_lag: int
          ) -> tuple[list[int], int]:
    """Indexes of the generations at most ``max_lag`` versions behind ``current`` (every
    token's version known), and how many were dropped."""
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    kept = [i for i, g in enumerate(generations)
            if (lag := g.lag(current)) is not None and lag <= max_lag]
    return kept, len(generations) - len(kept)
