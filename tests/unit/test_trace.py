"""Chrome traces of updates, their timelines, the simulated timeline and the Gantt PNGs.

The trace format is checked structurally (trace event format: metadata names
every process and thread; complete events carry pid, tid, ts and dur; spans
of one thread never overlap, which Perfetto requires) on spans from a real
transfer through the executor, and read back into the same bars.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys

import numpy as np
import pytest
from test_executor import Setup

from actors.controller.audit import UpdateClock, update_trace
from actors.messages import PlanSummary
from actors.reports import rank_report_of
from actors.tools.demo.run_config import ROOT
from scheduling import compute_plan, load_cluster_config, simulate
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scheduling.sim.timeline import merge_intervals, pick_rows, sim_timeline
from weight_transfer.model.models import load_model_config
from weight_transfer.observe.timeline import Bar, Timeline
from weight_transfer.observe.trace import (
    FORMAT,
    RankTrace,
    UpdateTrace,
    chrome_trace,
    nic_bound_seconds,
    rank_trace_of,
    read_chrome_trace,
    timeline_of_trace,
    write_chrome_trace,
)
from weight_transfer.sender.pipeline import Span


@pytest.fixture(scope="module")
def measured():
    """Two ranks' real transfers of one version (spans on this process's clock)."""
    s = Setup("tiny_moe", fp8=False, bandwidth_gbps=0.5)
    try:
        reports = [asyncio.run(s.transfer(r, watermark_bytes=8 << 20).run(version=4))
                   for r in (0, 1)]
    finally:
        s.close()
    return reports


def _update(reports, offset=1000.0, version=4):
    start = min(sp.start for r in reports for sp in r.spans)
    end = max(sp.end for r in reports for sp in r.spans)
    clock = UpdateClock(start=start - 0.01, paused=start - 0.005, transferred=end,
                        end=end + 0.01, offset=offset)

    summary = PlanSummary(plan_id=1, bytes_total=0, num_tasks=0, num_groups=1, replicas=(),
                          trainer_ranks=(), bytes_by_rank={}, replicas_by_rank={},
                          bytes_by_replica={}, send_nic_bytes={"a": 1_000_000, "b": 500},
                          recv_nic_bytes={"c": 10})
    traced = [rank_report_of(r, trace=rank_trace_of(r, nic=f"nic{r.rank}", clock_offset=offset))
              for r in reports]
    return update_trace(version=version, clock=clock, reports=traced, summary=summary,
                        send_bytes_per_s=1e9, recv_bytes_per_s=1e9)


def test_the_trace_is_well_formed_and_perfetto_safe(measured):
    doc = chrome_trace([_update(measured)])
    json.dumps(doc)  # plain JSON
    events = doc["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert names[(0, None)] == "controller"
    assert names[(1, None)] == "trainer rank 0 (nic0)" and names[(2, None)].startswith("trainer")
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "cat", "pid", "tid", "ts", "dur"} <= set(e) and e["dur"] >= 0
        if e["pid"] > 0:
            assert (e["pid"], e["tid"]) in names  # every rank track is named
    by_tid: dict = {}
    for e in spans:
        if e["pid"] > 0:
            by_tid.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for ivs in by_tid.values():  # Perfetto: slices of one thread must not overlap
        ivs.sort()
        assert all(b[0] >= a[1] - 1e-6 for a, b in itertools.pairwise(ivs))
    # A span per parameter and stage, and one per WRITE task, for each rank.
    for r in measured:
        mine = [e for e in spans if e["pid"] == r.rank + 1]
        assert sum(e["cat"] != "nic" for e in mine) == len(r.spans) + len(r.barrier_spans)
        assert sum(e["cat"] == "nic" for e in mine) == len(r.task_spans) == r.writes
        assert sum(e["args"]["bytes"] for e in mine if e["cat"] == "nic") == r.bytes_written
    controller = [e["name"] for e in spans if e["pid"] == 0]
    assert controller == ["update v4", "pause", "transfer", "resume", "NIC lower bound"]
    assert doc["otherData"]["format"] == FORMAT
    assert doc["otherData"]["updates"][0]["nic_bound_s"] == 1e-3  # 1 MB at 1 GB/s


def test_a_written_trace_reads_back_into_the_same_bars(measured, tmp_path):
    path = write_chrome_trace(tmp_path / "t.json", [_update(measured)])
    tl = timeline_of_trace(read_chrome_trace(path))
    assert tl.rows == ("rank 0", "rank 1")
    prepare = sorted(b.end - b.start for b in tl.bars if b.row == "rank 1" and
                     b.stage == "prepare")
    want = sorted(sp.end - sp.start for sp in measured[1].spans if sp.stage == "prepare")
    assert np.allclose(prepare, want, atol=1e-6)
    assert tl.bound_seconds == pytest.approx(0.005 + 1e-3)  # transfer start + bound
    assert all(b.start >= 0 for b in tl.bars)


def test_traces_of_several_updates_and_bad_files(tmp_path):
    def one(version, at):
        span = Span(key="p", stage="prepare", start=1.0, end=2.0, nbytes=8)
        rt = RankTrace(rank=0, nic="n", clock_offset=at - 1.0, spans=(span,))
        return UpdateTrace(version=version, started_at=at, seconds=1.0, ranks=(rt,))

    path = write_chrome_trace(tmp_path / "t.json", [one(2, 50.0), one(1, 10.0)])
    doc = read_chrome_trace(path)
    assert [u["version"] for u in doc["otherData"]["updates"]] == [1, 2]
    assert timeline_of_trace(doc, version=2).bars == (
        Bar(row="rank 0", stage="prepare", start=0.0, end=1.0),)
    with pytest.raises(ValueError, match=r"no update 3; it has \[1, 2\]"):
        timeline_of_trace(doc, version=3)
    (tmp_path / "x.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match=r"x\.json: not a weight-transfer trace"):
        read_chrome_trace(tmp_path / "x.json")
    with pytest.raises(ValueError, match="no update traces"):
        chrome_trace([])


@pytest.mark.parametrize("send,recv,want", [
    ({"a": 10, "b": 30}, {"c": 20}, 3.0),
    ({"a": 10}, {"c": 40}, 4.0),
    ({}, {}, 0.0),
])
def test_nic_bound(send, recv, want):
    assert nic_bound_seconds(send, recv, send_bytes_per_s=10, recv_bytes_per_s=10) == want


@pytest.mark.parametrize("intervals,gap,want", [
    ([], 0.0, []),
    ([(0, 1), (2, 3)], 0.0, [(0, 1), (2, 3)]),
    ([(0, 1), (1.5, 3)], 0.6, [(0, 3)]),
    ([(2, 3), (0, 5), (6, 7)], 0.0, [(0, 5), (6, 7)]),  # one interval covers another
])
def test_merge_intervals(intervals, gap, want):
    s = np.array([a for a, _ in intervals], dtype=float)
    e = np.array([b for _, b in intervals], dtype=float)
    assert merge_intervals(s, e, gap) == want


@pytest.mark.parametrize("n,cap,want", [(3, None, [0, 1, 2]), (3, 5, [0, 1, 2]),
                                        (10, 3, [0, 4, 9]), (256, 2, [0, 255])])
def test_pick_rows(n, cap, want):
    assert pick_rows(n, cap) == want


def test_timeline_merging_joins_only_close_bars_of_one_row_and_stage():
    tl = Timeline(title="t", rows=("a",), bars=(
        Bar(row="a", stage="x", start=0, end=1), Bar(row="a", stage="x", start=1.05, end=2),
        Bar(row="a", stage="y", start=1.5, end=3)))
    assert sorted((b.stage, b.start, b.end) for b in tl.merged(0.1).bars) == [
        ("x", 0, 2), ("y", 1.5, 3)]
    assert tl.stages == ("x", "y") and tl.end == 3


def _plan(model="tiny_moe"):
    cfg = load_model_config(ROOT / "configs" / "models" / f"{model}.yaml")
    cl = load_cluster_config(ROOT / "configs" / "clusters" / "local_cpu.yaml")
    return compute_plan(trainer_meta_from_config(cfg, cl), engine_metas_from_config(cfg, cl),
                        cl, model=cfg), cl


def test_simulated_task_times_are_consistent_with_the_result():
    plan, cl = _plan()
    plain = simulate(plan, cl)
    r = simulate(plan, cl, record=True)
    assert plain.task_start is None and r.seconds == plain.seconds  # recording changes nothing
    assert (r.task_end >= r.task_start).all() and r.task_end.max() == pytest.approx(r.seconds)
    bounds = np.cumsum((0.0, *r.group_seconds))
    for g in range(plan.num_groups):  # every task runs inside its group
        mine = plan.task_group == g
        assert r.task_start[mine].min() >= bounds[g] - 1e-12
        assert r.task_end[mine].max() <= bounds[g + 1] + 1e-12
    tl = sim_timeline(plan, r)
    assert tl.rows == tuple(f"rank {x.rank}" for x in plan.trainer_ranks)
    assert {b.stage for b in tl.bars} <= {"nic", "barrier"}
    assert tl.bound_seconds == r.lower_bound_seconds
    with pytest.raises(ValueError, match="record=True"):
        sim_timeline(plan, plain)


def test_gantt_pngs_of_a_trace_and_a_simulation(measured, tmp_path):
    pytest.importorskip("matplotlib", reason="the plots extra is not installed")
    from actors.tools.cli.plots import draw_gantt

    plan, cl = _plan()
    doc = chrome_trace([_update(measured)])
    out = draw_gantt([timeline_of_trace(doc), sim_timeline(plan, simulate(plan, cl,
                                                                          record=True))],
                     tmp_path / "g.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drawing_without_matplotlib_names_the_extra(monkeypatch):
    from actors.tools.cli.plots import MissingExtraError, import_pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"plots. extra: pip install -e '\.\[plots\]'"):
        import_pyplot()
