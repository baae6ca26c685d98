"""Refused barrier arrivals get audit lines of their own (actors.controller.audit.RefusedAudit)."""

from __future__ import annotations

import pickle

from actors.controller.audit import AuditLog, read_audit
from actors.controller.update import refusals_of
from actors.reports import TrainerFault
from weight_transfer.errors import BarrierRefusedError, FaultKind


def test_a_refused_arrival_becomes_a_refused_line(tmp_path):
    err = BarrierRefusedError("barrier b/v3/g1: forged arrival of rank 2 refused by rank 0",
                              barrier="b/v3/g1", rank=2, tag="v3/g1", reason="forged")
    err = pickle.loads(pickle.dumps(err))  # as Ray carries it
    errors = {0: TrainerFault(rank=0, kind=FaultKind.FAILED, error=str(err), cause=err),
              1: TrainerFault(rank=1, kind=FaultKind.FAILED, error="RuntimeError: other",
                              cause=RuntimeError("other")),
              3: TrainerFault(rank=3, kind=FaultKind.ABORTED, error="did not finish")}
    (entry,) = refusals_of(3, errors)
    log = AuditLog(tmp_path / "audit.jsonl")
    log.record(entry)
    (line,) = read_audit(tmp_path / "audit.jsonl")
    assert line["kind"] == "refused" and line["version"] == 3
    assert (line["what"], line["rank"], line["tag"], line["reason"], line["by"]) == (
        "barrier arrival", 2, "v3/g1", "forged", "trainer rank 0")
    assert "forged arrival of rank 2" in line["error"]


def test_no_refusal_no_line():
    assert refusals_of(1, {}) == ()
