"""The simulated execution of a plan as a :class:`~weight_transfer.observe.timeline.Timeline`.

:func:`scheduling.sim.simulate.simulate` with ``record=True`` keeps when each task
started and ended; this draws them the way a measured trace is drawn (``wt
simulate --png``, beside ``wt trace --png``): per trainer rank, ``nic`` bars
while the rank has writes in flight, and ``barrier`` bars from its last write
of a mesh group to the group's end (waiting for the slowest rank)::

    result = simulate(plan, cluster, record=True)
    timeline = sim_timeline(plan, result)        # at most 16 ranks, spread evenly

The model has no h2d or prepare stage (it assumes they keep up with the NICs).
Writes of one rank closer together than ``gap`` (default: 1/2000 of the run)
are drawn as one bar, so a million tasks stay a few thousand bars.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from weight_transfer.observe.timeline import Bar, Timeline

if TYPE_CHECKING:
    from scheduling.plan import Plan
    from scheduling.sim.simulate import SimResult


def merge_intervals(start: np.ndarray, end: np.ndarray, gap: float) -> list[tuple[float, float]]:
    """Union of intervals, joining those less than ``gap`` apart."""
    if len(start) == 0:
        return []
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    new = np.concatenate(([True], s[1:] > reach[:-1] + gap))
    firsts = np.flatnonzero(new)
    lasts = np.append(firsts[1:], len(s)) - 1
    return list(zip(s[firsts].tolist(), reach[lasts].tolist(), strict=True))


def pick_rows(n: int, max_rows: int | None) -> list[int]:
    """Up to ``max_rows`` indices spread evenly over ``range(n)``, first and last included."""
    if max_rows is None or n <= max_rows:
        return list(range(n))
    return sorted({round(i * (n - 1) / (max_rows - 1)) for i in range(max_rows)})


def sim_timeline(plan: Plan, result: SimResult, *, max_rows: int | None = 16,
                 gap: float | None = None, title: str = "") -> Timeline:
    if result.task_start is None or result.task_end is None:
        raise ValueError("sim_timeline needs simulate(..., record=True)")
    gap = result.seconds / 2000 if gap is None else gap
    bounds = np.cumsum((0.0, *result.group_seconds))
    ranks = plan.trainer_ranks
    rows, bars = [], []
    for idx in pick_rows(len(ranks), max_rows):
        row = f"rank {ranks[idx].rank}"
        rows.append(row)
        mine = plan.task_src == idx
        for s, e in merge_intervals(result.task_start[mine], result.task_end[mine], gap):
            bars.append(Bar(row=row, stage="nic", start=s, end=e))
        for g in range(plan.num_groups):
            in_group = mine & (plan.task_group == g)
            last = float(result.task_end[in_group].max()) if in_group.any() else bounds[g]
            if bounds[g + 1] - last > gap:
                bars.append(Bar(row=row, stage="barrier", start=last, end=float(bounds[g + 1])))
    shown = "" if len(rows) == len(ranks) else f", {len(rows)} of {len(ranks)} ranks"
    return Timeline(
        title=title or f"simulated: {result.seconds:.4f} s (NIC bound "
                       f"{result.lower_bound_seconds:.4f} s{shown})",
        rows=tuple(rows), bars=tuple(bars), bound_seconds=result.lower_bound_seconds)
