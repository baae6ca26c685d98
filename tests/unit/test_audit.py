"""The audit log: one JSON line per record, fields as the reports say, lines never torn."""

import json
import multiprocessing as mp

import numpy as np
import pytest

from actors.controller.audit import AuditLog, ResyncAudit, UpdateAudit, read_audit
from actors.controller.checks import IntegrityResult, Mismatch
from actors.reports import RankReport
from weight_transfer.sender.executor import TransferReport


def rank_report(rank, dest):
    t = TransferReport(rank=rank, version=4, seconds=0.5, bytes_written=sum(dest.values()),
                       bytes_planned=sum(dest.values()), writes=len(dest), params_gathered=1,
                       barrier_seconds=0.0, watermark_peak=0, spans=(), retries=rank,
                       dest_bytes=dest)
    return RankReport(transfer=t)


def test_update_and_resync_records_carry_the_reported_fields(tmp_path):
    log = AuditLog(tmp_path / "sub" / "audit.jsonl")  # the directory is created
    reports = [rank_report(1, {"engine0/tp0": 30, "engine1/tp0": 40}),
               rank_report(0, {"engine0/tp1": 10})]
    check = IntegrityResult(mode="sample", ranges=3, bytes=60, seconds=0.01, mismatches=(
        Mismatch(replica="engine1", rank=0, tensor="w", tensor_offset=8, length=16, task=5,
                 expected=1, actual=2),))
    log.record(UpdateAudit(version=4, started_at=100.0, finished_at=101.5, reports=reports,
                           outcome="failed", torn=("engine1",), integrity=check,
                           replicas=("engine0", "engine1"), error="boom"))
    log.record(ResyncAudit(version=4, source="engine0", target="engine1", started_at=102.0,
                           finished_at=102.25, pairs={("engine0/tp0", "engine1/tp0"): 70},
                           outcome="ok"))
    up, rs = read_audit(log.path)
    assert up["kind"] == "update" and up["version"] == 4 and up["seconds"] == 1.5
    assert up["pairs"] == [{"src": "trainer0", "dst": "engine0/tp1", "bytes": 10},
                           {"src": "trainer1", "dst": "engine0/tp0", "bytes": 30},
                           {"src": "trainer1", "dst": "engine1/tp0", "bytes": 40}]
    assert up["bytes"] == 80 and up["retries"] == 1
    assert up["outcome"] == "failed" and up["torn"] == ["engine1"] and up["error"] == "boom"
    assert up["integrity"]["mode"] == "sample" and up["integrity"]["ok"] is False
    assert "engine1/tp0 tensor 'w' bytes [8, 24)" in up["integrity"]["mismatches"][0]
    assert rs == {"kind": "resync", "version": 4, "source": "engine0", "target": "engine1",
                  "started_at": 102.0, "finished_at": 102.25, "seconds": 0.25, "bytes": 70,
                  "pairs": [{"src": "engine0/tp0", "dst": "engine1/tp0", "bytes": 70}],
                  "integrity": None, "outcome": "ok", "torn": [], "error": None}


def _writer(path, who, n):
    log = AuditLog(path)
    for i in range(n):
        log.record(ResyncAudit(version=i, source=who, target="x" * 5000, started_at=0.0,
                               finished_at=1.0, pairs={}, outcome="ok"))


def test_lines_of_concurrent_writers_never_interleave(tmp_path):
    path = tmp_path / "audit.jsonl"
    procs = [mp.get_context("fork").Process(target=_writer, args=(path, f"w{k}", 50))
             for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    records = read_audit(path)
    assert len(records) == 150
    for k in range(3):
        assert [r["version"] for r in records if r["source"] == f"w{k}"] == list(range(50))


def test_read_audit_names_a_bad_line_and_a_directory_is_refused(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"kind": "update"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"a.jsonl:2: not a JSON line"):
        read_audit(path)
    with pytest.raises(ValueError, match="is a directory"):
        AuditLog(tmp_path)


def test_integrity_result_summary():
    ok = IntegrityResult(mode="full", ranges=2, bytes=8, seconds=0.0)
    assert ok.ok and ok.torn == [] and ok.as_dict()["algorithm"] == "xxh3_64"
    bad = IntegrityResult(mode="full", ranges=2, bytes=8, seconds=0.0, mismatches=tuple(
        Mismatch(replica=f"e{i % 2}", rank=0, tensor="", tensor_offset=0, length=1, task=i,
                 expected=int(np.uint64(i)), actual=None, error="did not answer")
        for i in range(7)))
    assert bad.torn == ["e0", "e1"]
    assert "and 2 more" in bad.message() and "not checked: did not answer" in bad.message()


def test_an_update_that_fails_before_recording_itself_still_leaves_a_line(tmp_path):
    from actors.controller.state import ControllerState
    from actors.controller.update import UpdateOutcome, check_version
    from weight_transfer.errors import UpdateError

    log = AuditLog(tmp_path / "a.jsonl")
    state = ControllerState(trainers=[], connector=None, summary=object(), attempted=2)
    with pytest.raises(ValueError, match="must be greater than 2"):
        check_version(state, 2)  # refused: not an update, so the controller records nothing
    err = TimeoutError("pause before version 3: engine0/tp1 did not answer")
    crashed = UpdateOutcome(version=3, replicas=("engine0", "engine1"), error=err, crashed=True)
    log.record(crashed.audit(started_at=1.0, finished_at=2.0))
    failed = UpdateError("update to version 4 failed on replicas ['engine1']", version=4,
                         ranks={}, torn=["engine1"])
    log.record(UpdateOutcome(version=4, replicas=("engine0", "engine1"), error=failed)
               .audit(started_at=3.0, finished_at=4.0))
    line, line4 = read_audit(tmp_path / "a.jsonl")
    assert line["version"] == 3 and line["outcome"] == "failed" and line["pairs"] == []
    assert line["error"] == "TimeoutError: pause before version 3: engine0/tp1 did not answer"
    assert line["replicas"] == ["engine0", "engine1"] and line["torn"] == []
    assert line4["version"] == 4 and line4["outcome"] == "failed"
    assert line4["error"] == str(failed) and line4["torn"] == ["engine1"]


def test_update_lines_carry_what_the_engines_refused(tmp_path):
    from actors.controller.audit import refused_counts

    refused = refused_counts(["engine0/tp0", "engine0/tp1"],
                             [{"refused_connections": 3, "refused_writes": 1},
                              {"bytes_written": 5}])
    assert refused == {"engine0/tp0": {"connections": 3, "writes": 1}}
    log = AuditLog(tmp_path / "a.jsonl")
    log.record(UpdateAudit(version=1, started_at=0.0, finished_at=1.0, outcome="ok",
                           refused=refused))
    assert read_audit(tmp_path / "a.jsonl")[0]["refused"] == refused
