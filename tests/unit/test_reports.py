"""Update reports: stage busy times, compact rank reports, combining ranks."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from actors.reports import (
    STAGES,
    RankReport,
    UpdateReport,
    WriteFailure,
    busy_seconds,
    rank_report_of,
    stage_seconds,
)
from weight_transfer.sender.executor import TransferReport
from weight_transfer.sender.pipeline import Span


@pytest.mark.parametrize(
    "intervals, want",
    [
        ([], 0.0),
        ([(0, 1)], 1.0),
        ([(0, 1), (0.5, 2)], 2.0),  # overlap counts once
        ([(0, 1), (2, 3)], 2.0),  # gap does not count
        ([(2, 3), (0, 1), (0.2, 0.4)], 2.0),  # unordered, nested
        ([(0, 1), (1, 2)], 2.0),  # touching
    ],
)
def test_busy_seconds_is_the_union_length(intervals, want):
    assert busy_seconds(intervals) == pytest.approx(want)


def test_busy_seconds_refuses_reversed_interval():
    with pytest.raises(ValueError, match="ends before it starts"):
        busy_seconds([(2.0, 1.0)])


def _span(key, stage, start, end):
    return Span(key=key, stage=stage, start=start, end=end, nbytes=10)


def _transfer(rank=0, version=3, spans=(), barrier=0.5, nbytes=700, writes=7, seconds=2.0):
    return TransferReport(rank=rank, version=version, seconds=seconds, bytes_written=nbytes,
                          bytes_planned=1000, writes=writes, params_gathered=4,
                          barrier_seconds=barrier, watermark_peak=77, spans=tuple(spans),
                          task_spans=tuple(spans))


def test_stage_seconds_per_stage_and_barrier():
    spans = [_span("a", "prepare", 0, 1), _span("a", "write", 1, 3), _span("b", "write", 2, 4),
             _span("b", "prepare", 1, 2)]
    got = stage_seconds(spans, barrier_seconds=0.25)
    assert list(got)[: len(STAGES)] == list(STAGES)
    assert got == {"h2d": 0.0, "prepare": 2.0, "write": 3.0, "barrier": 0.25}


def test_rank_report_keeps_the_executors_counts_drops_spans_and_keeps_size_constant():
    fail = WriteFailure(replica="engine1", owner="engine1/tp0", count=3, nbytes=300, error="x")
    few = rank_report_of(_transfer(spans=[_span("p", "write", 0, 1)]), failures=[fail])
    t = few.transfer
    assert (few.rank, t.bytes_written, t.bytes_planned, t.writes) == (0, 700, 1000, 7)
    assert t.spans == t.task_spans == () and t.watermark_peak == 77
    assert not few.ok and few.failed_replicas == ("engine1",)
    many = rank_report_of(_transfer(spans=[_span(f"p{i}", "write", i, i + 1) for i in range(500)]),
                          failures=[fail])
    assert many.stages["write"] == pytest.approx(500.0)
    # Per-stage sums, not spans: the report does not grow with the parameter count.
    assert len(pickle.dumps(many)) == len(pickle.dumps(few))


def _rank(rank, seconds, stages, nbytes=100, version=5):
    transfer = _transfer(rank=rank, version=version, seconds=seconds, nbytes=nbytes, writes=1)
    return RankReport(transfer=dataclasses.replace(transfer, spans=(), task_spans=()),
                      stages=stages)


def test_combine_sums_bytes_and_takes_the_slowest_rank_per_stage():
    ranks = [_rank(1, 2.0, {"prepare": 1.0, "write": 0.5, "barrier": 0.1}),
             _rank(0, 1.0, {"prepare": 0.5, "write": 1.5, "barrier": 0.3})]
    rep = UpdateReport.combine(version=5, seconds=4.0, per_rank=ranks, control_bytes=123)
    assert rep.bytes == 200 and rep.transfer_seconds == 2.0
    assert rep.stages == {"prepare": 1.0, "write": 1.5, "barrier": 0.3}
    assert rep.stages_summed == {"prepare": 1.5, "write": 2.0, "barrier": pytest.approx(0.4)}
    assert [r.rank for r in rep.per_rank] == [0, 1]
    assert rep.gb_per_s == pytest.approx(200 / 4.0 / 1e9)
    assert rep.as_dict()["control_bytes"] == 123
    assert rep.as_dict()["per_rank"][1] == {"rank": 1, "seconds": 2.0, "bytes": 100, "writes": 1,
                                            "stages": {"prepare": 1.0, "write": 0.5,
                                                       "barrier": 0.1}}


def test_combine_refuses_mixed_versions_and_nothing():
    with pytest.raises(ValueError, match=r"ranks \[1\] report another version"):
        UpdateReport.combine(version=5, seconds=1.0,
                             per_rank=[_rank(0, 1.0, {}), _rank(1, 1.0, {}, version=4)])
    with pytest.raises(ValueError, match="no rank reports"):
        UpdateReport.combine(version=5, seconds=1.0, per_rank=[])
