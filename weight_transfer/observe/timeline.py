"""A timeline to draw: bars of stages per row (trainer rank), in seconds from the start.

Plain data shared by the measured traces (:func:`weight_transfer.observe.trace.timeline_of_trace`)
and the simulated ones (:func:`scheduling.sim.timeline.sim_timeline`), so both
are drawn the same way (``wt trace --png``, ``wt simulate --png``)::

    tl = Timeline(title="update v3", rows=("rank 0", "rank 1"),
                  bars=(Bar(row="rank 0", stage="prepare", start=0.0, end=0.1), ...),
                  bound_seconds=0.08)
    tl.merged(min_gap=1e-4)   # touching bars of one row and stage joined (fewer to draw)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Drawing order within a row, top to bottom; other stages follow.
STAGE_ORDER: tuple[str, ...] = ("h2d", "prepare", "write", "nic", "barrier")


@dataclass(frozen=True, slots=True, kw_only=True)
class Bar:
    row: str
    stage: str
    start: float
    end: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    title: str
    rows: tuple[str, ...]
    bars: tuple[Bar, ...]
    bound_seconds: float | None = None  # the NIC lower bound, from the timeline's 0

    @property
    def stages(self) -> tuple[str, ...]:
        seen = {b.stage for b in self.bars}
        return (*(s for s in STAGE_ORDER if s in seen), *sorted(seen - set(STAGE_ORDER)))

    @property
    def end(self) -> float:
        return max((b.end for b in self.bars), default=0.0)

    def merged(self, min_gap: float = 0.0) -> Timeline:
        """Bars of one row and stage that overlap or are closer than ``min_gap`` joined."""
        groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for b in self.bars:
            groups.setdefault((b.row, b.stage), []).append((b.start, b.end))
        out = []
        for (row, stage), intervals in groups.items():
            intervals.sort()
            cur_s, cur_e = intervals[0]
            for s, e in intervals[1:]:
                if s <= cur_e + min_gap:
                    cur_e = max(cur_e, e)
                else:
                    out.append(Bar(row=row, stage=stage, start=cur_s, end=cur_e))
                    cur_s, cur_e = s, e
            out.append(Bar(row=row, stage=stage, start=cur_s, end=cur_e))
        return replace(self, bars=tuple(out))
