"""Timelines of weight updates as Chrome traces (Perfetto / chrome://tracing readable).

A trainer rank asked for a trace returns a :class:`RankTrace` (its executor
spans with the offset from its ``perf_counter`` clock to wall-clock time); the
controller wraps the ranks' traces of one update in an :class:`UpdateTrace`;
:func:`chrome_trace` turns any number of updates into the JSON object format of
the trace event format::

    doc = chrome_trace([report.trace for report in reports])
    write_chrome_trace("update.json", [report.trace])   # open in ui.perfetto.dev

Layout: process 0 is the controller (one span per update, its pause, transfer
and resume inside, and the NIC lower bound on its own track); process ``r + 1``
is trainer rank ``r``, with one track per stage (``h2d``, ``prepare``,
``write``: a span per parameter and stage; ``barrier``: a span per mesh group;
``nic``: a span per WRITE task). Perfetto needs the spans of one track to nest,
and a rank's stages overlap by design, so stages that run concurrently (writes)
take as many lanes as they have spans in flight. Timestamps are microseconds
from the first update's start; every span's ``args`` carry ``rank``, ``stage``,
``bytes`` and ``version``, and ``otherData`` lists the updates, so
:func:`timeline_of_trace` can read a file back into a
:class:`~weight_transfer.observe.timeline.Timeline` to draw.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weight_transfer.observe.timeline import Bar, Timeline
from weight_transfer.sender.pipeline import Span

FORMAT = "weight-transfer trace 1"
# Track order within a rank; "nic" holds the WRITE tasks (the NIC busy).
TRACKS: tuple[str, ...] = ("h2d", "prepare", "write", "nic", "barrier")


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTrace:
    """One trainer rank's spans of one update; times on its ``perf_counter`` clock."""

    rank: int
    nic: str
    clock_offset: float  # add to a span time to get time.time()
    spans: tuple[Span, ...]  # per (parameter, stage)
    task_spans: tuple[Span, ...] = ()  # per WRITE task
    barrier_spans: tuple[Span, ...] = ()  # per mesh group


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateTrace:
    """One update: its ranks' traces and the controller's phases, in wall-clock seconds."""

    version: int
    started_at: float
    seconds: float
    ranks: tuple[RankTrace, ...]
    phases: tuple[tuple[str, float, float], ...] = ()  # (name, start, end), time.time()
    nic_bound_seconds: float = 0.0  # max over NICs of planned bytes / line rate
    transfer_started_at: float = 0.0


def nic_bound_seconds(send_nic_bytes: Mapping[str, int], recv_nic_bytes: Mapping[str, int],
                      *, send_bytes_per_s: float, recv_bytes_per_s: float) -> float:
    """The NIC lower bound: the busiest NIC's bytes at its line rate."""
    send = max(send_nic_bytes.values(), default=0) / send_bytes_per_s
    recv = max(recv_nic_bytes.values(), default=0) / recv_bytes_per_s
    return max(send, recv)


def _lanes(intervals: list[tuple[float, float, Any]]) -> list[tuple[int, float, float, Any]]:
    """Greedy interval colouring: each interval gets the first lane free at its start."""
    ends: list[float] = []
    out = []
    for start, end, item in sorted(intervals, key=lambda x: (x[0], x[1])):
        lane = next((i for i, e in enumerate(ends) if e <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        out.append((lane, start, end, item))
    return out


def _rank_events(update: UpdateTrace, rt: RankTrace, t0: float,
                 tids: dict[tuple[int, str, int], int]) -> list[dict]:
    pid = rt.rank + 1
    by_track: dict[str, list[tuple[float, float, Any]]] = {t: [] for t in TRACKS}
    for sp in rt.spans:
        by_track.setdefault(sp.stage, []).append((sp.start, sp.end, (str(sp.key), sp.nbytes)))
    for sp in rt.task_spans:
        by_track["nic"].append((sp.start, sp.end, (f"task {sp.key}", sp.nbytes)))
    for sp in rt.barrier_spans:
        by_track["barrier"].append((sp.start, sp.end, (f"group {sp.key}", 0)))
    events = []
    order = [*TRACKS, *sorted(set(by_track) - set(TRACKS))]
    for k, track in enumerate(order):
        for lane, start, end, (name, nbytes) in _lanes(by_track[track]):
            if (pid, track, lane) not in tids:
                tids[pid, track, lane] = tid = len(tids) + 1
                label = track if lane == 0 else f"{track} #{lane + 1}"
                events += [
                    {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                     "args": {"name": label}},
                    {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                     "args": {"sort_index": k * 1000 + lane}},
                ]
            events.append({
                "ph": "X", "name": name, "cat": track, "pid": pid, "tid": tids[pid, track, lane],
                "ts": (start + rt.clock_offset - t0) * 1e6, "dur": (end - start) * 1e6,
                "args": {"rank": rt.rank, "stage": track, "bytes": nbytes,
                         "version": update.version},
            })
    return events


def chrome_trace(updates: Iterable[UpdateTrace]) -> dict[str, Any]:
    """The trace event JSON object of ``updates`` (see the module docstring)."""
    updates = sorted(updates, key=lambda u: u.started_at)
    if not updates:
        raise ValueError("chrome_trace: no update traces (was the update run with trace=True?)")
    t0 = updates[0].started_at
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "controller"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "update"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "NIC bound"}},
    ]
    named: set[int] = set()
    tids: dict[tuple[int, str, int], int] = {}
    for u in updates:
        us = (u.started_at - t0) * 1e6
        events.append({"ph": "X", "name": f"update v{u.version}", "cat": "update", "pid": 0,
                       "tid": 0, "ts": us, "dur": u.seconds * 1e6,
                       "args": {"version": u.version}})
        for name, start, end in u.phases:
            events.append({"ph": "X", "name": name, "cat": "update", "pid": 0, "tid": 0,
                           "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6,
                           "args": {"version": u.version}})
        if u.nic_bound_seconds > 0:
            start = (u.transfer_started_at or u.started_at) - t0
            events.append({"ph": "X", "name": "NIC lower bound", "cat": "bound", "pid": 0,
                           "tid": 1, "ts": start * 1e6, "dur": u.nic_bound_seconds * 1e6,
                           "args": {"version": u.version, "seconds": u.nic_bound_seconds}})
        for rt in sorted(u.ranks, key=lambda r: r.rank):
            if rt.rank + 1 not in named:
                named.add(rt.rank + 1)
                events += [
                    {"ph": "M", "name": "process_name", "pid": rt.rank + 1,
                     "args": {"name": f"trainer rank {rt.rank} ({rt.nic})"}},
                    {"ph": "M", "name": "process_sort_index", "pid": rt.rank + 1,
                     "args": {"sort_index": rt.rank + 1}},
                ]
            events += _rank_events(u, rt, t0, tids)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": FORMAT,
            "updates": [{"version": u.version, "start_s": u.started_at - t0,
                         "seconds": u.seconds, "nic_bound_s": u.nic_bound_seconds,
                         "transfer_start_s": (u.transfer_started_at or u.started_at) - t0,
                         "ranks": {str(r.rank): r.nic for r in u.ranks}}
                        for u in updates],
        },
    }


def write_chrome_trace(path: str | Path, updates: Iterable[UpdateTrace]) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(updates)))
    return path


def read_chrome_trace(path: str | Path) -> dict[str, Any]:
    """A trace written by :func:`write_chrome_trace`; ValueError names the file and the problem."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a trace: {exc}") from None
    if not isinstance(doc, dict) or doc.get("otherData", {}).get("format") != FORMAT:
        raise ValueError(f"{path}: not a weight-transfer trace (otherData.format is not "
                         f"{FORMAT!r}); write one with `wt demo --trace PATH`")
    return doc


def timeline_of_trace(doc: Mapping[str, Any], *, version: int | None = None,
                      title: str = "") -> Timeline:
    """The stages per trainer rank of one update of a trace (default: the last one)."""
    updates = doc["otherData"]["updates"]
    versions = [u["version"] for u in updates]
    if not updates:
        raise ValueError("the trace holds no update")
    if version is None:
        version = versions[-1]
    if version not in versions:
        raise ValueError(f"the trace has no update {version}; it has {versions}")
    u = updates[versions.index(version)]
    start = u["start_s"]
    bars = []
    for ev in doc["traceEvents"]:
        args = ev.get("args", {})
        if ev.get("ph") != "X" or "rank" not in args or args.get("version") != version:
            continue
        t = ev["ts"] / 1e6 - start
        bars.append(Bar(row=f"rank {args['rank']}", stage=args["stage"], start=t,
                        end=t + ev["dur"] / 1e6))
    rows = tuple(f"rank {r}" for r in sorted(int(r) for r in u["ranks"]))
    bound = u["nic_bound_s"]
    return Timeline(
        title=title or f"update v{version}: {u['seconds']:.3f} s",
        rows=rows, bars=tuple(bars),
        bound_seconds=(u["transfer_start_s"] - start + bound) if bound > 0 else None,
    )


def trace_versions(doc: Mapping[str, Any]) -> list[int]:
    return [u["version"] for u in doc["otherData"]["updates"]]


def rank_trace_of(report: Any, *, nic: str, clock_offset: float) -> RankTrace:
    """The spans of a :class:`~weight_transfer.sender.executor.TransferReport` as a RankTrace."""
    return RankTrace(rank=report.rank, nic=nic, clock_offset=clock_offset,
                     spans=tuple(report.spans), task_spans=tuple(report.task_spans),
                     barrier_spans=tuple(getattr(report, "barrier_spans", ())))


__all__: Sequence[str] = ("FORMAT", "TRACKS", "RankTrace", "UpdateTrace", "chrome_trace",
                          "nic_bound_seconds", "rank_trace_of", "read_chrome_trace",
                          "timeline_of_trace", "trace_versions", "write_chrome_trace")
