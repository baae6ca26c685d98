"""``wt trace PATH --png OUT``: draw a Chrome trace of updates as a Gantt chart.

The trace is what ``wt demo --trace PATH`` or ``controller.update(v, trace=PATH)``
wrote (:mod:`weight_transfer.observe.trace`). The chart has one band per trainer rank
and one lane per stage (``h2d``, ``prepare``, ``write``, ``nic``: WRITE tasks
in flight, ``barrier``), coloured by stage, with the NIC lower bound of the
plan as a dashed line (:mod:`actors.tools.cli.plots`). ``--version V`` picks one update
(default: every update of the file, one panel each)::

    wt demo --updates 2 --trace /tmp/demo.json
    wt trace /tmp/demo.json --png /tmp/demo.png
    wt simulate --model M --cluster C --png /tmp/sim.png    # the model's prediction
"""

from __future__ import annotations

from pathlib import Path

from actors.tools.cli.progress import command_console
from weight_transfer.observe.trace import read_chrome_trace, timeline_of_trace, trace_versions


def run_trace(path: Path, *, png: Path | None, version: int | None) -> int:
    console = command_console()
    try:
        doc = read_chrome_trace(path)
        versions = trace_versions(doc) if version is None else [version]
        timelines = [timeline_of_trace(doc, version=v) for v in versions]
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    for tl in timelines:
        console.print(f"{tl.title}: {len(tl.rows)} trainer ranks, {len(tl.bars)} spans")
    if png is None:
        console.print("open the file in https://ui.perfetto.dev, or draw it with --png OUT")
        return 0
    from actors.tools.cli.plots import MissingExtraError, draw_gantt

    try:
        draw_gantt(timelines, png)
    except MissingExtraError as err:
        console.print(f"[red]cannot draw {png}:[/red] {err}")
        return 2
    console.print(f"wrote {png}")
    return 0
