"""Gantt charts of update timelines (matplotlib, the optional ``plots`` extra).

One band per trainer rank, one thin lane per stage inside it, coloured by
stage, and the NIC lower bound as a dashed vertical line: where the ``nic``
lane has gaps before the bound, the NIC waited for the stages before it; a
long ``barrier`` bar is a rank waiting for the slowest one::

    draw_gantt([timeline_of_trace(doc)], Path("trace.png"))
    draw_gantt([measured, simulated], Path("both.png"))   # panels one above the other
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weight_transfer.errors import WeightTransferError
from weight_transfer.observe.timeline import Timeline

COLOURS = {"h2d": "#8c8c8c", "prepare": "#4c72b0", "write": "#dd8452", "nic": "#55a868",
           "barrier": "#c44e52"}
LABELS = {"h2d": "h2d (to device)", "prepare": "prepare (gather, cut, quantize)",
          "write": "write stage (per parameter)", "nic": "NIC busy (WRITE tasks in flight)",
          "barrier": "barrier (waiting for other ranks)"}


class MissingExtraError(WeightTransferError, RuntimeError):
    """matplotlib is not installed."""


def import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError(
            "drawing PNGs needs matplotlib, the optional `plots` extra: "
            "pip install -e '.[plots]' (scripts/setup.sh installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax: Any, tl: Timeline) -> None:
    stages = tl.stages
    lane_h = 0.8 / max(len(stages), 1)
    tl = tl.merged(min_gap=(tl.end or 1.0) / 4000)
    rows = {r: i for i, r in enumerate(tl.rows)}
    for stage in stages:
        k = stages.index(stage)
        for row, i in rows.items():
            spans = [(b.start, b.end - b.start) for b in tl.bars if b.row == row and
                     b.stage == stage]
            if spans:
                ax.broken_barh(spans, (i - 0.4 + k * lane_h, lane_h * 0.9),
                               facecolors=COLOURS.get(stage, "#937860"))
    if tl.bound_seconds is not None:
        ax.axvline(tl.bound_seconds, color="black", linestyle="--", linewidth=1.2)
        ax.annotate("NIC bound", (tl.bound_seconds, -0.6), xytext=(3, 0),
                    textcoords="offset points", fontsize=8, va="top")
    ax.set_yticks(range(len(tl.rows)), tl.rows)
    ax.set_ylim(len(tl.rows) - 0.5, -0.75)  # rank 0 on top
    right = max(tl.end, tl.bound_seconds or 0.0)
    ax.set_xlim(0, right * 1.03 if right > 0 else 1.0)
    ax.set_xlabel("seconds from the update's start")
    ax.set_title(tl.title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def draw_gantt(timelines: Sequence[Timeline], out: Path) -> Path:
    """One panel per timeline, one above the other; writes ``out`` (PNG)."""
    plt = import_pyplot()
    from matplotlib.patches import Patch

    heights = [max(2.0, 0.5 * len(t.rows) + 1.2) for t in timelines]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, sum(heights) + 0.6),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, tl in zip(axes[:, 0], timelines, strict=True):
        _draw(ax, tl)
    stages = list(dict.fromkeys(s for tl in timelines for s in tl.stages))
    fig.legend(handles=[Patch(color=COLOURS.get(s, "#937860"), label=LABELS.get(s, s))
                        for s in stages], loc="upper center", ncol=min(len(stages), 5),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (sum(heights) + 0.6)))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
