"""Audit log: one JSON line per update and per re-sync, appended to a file.

The controller records every update, successful or not, and every re-sync of a
replica from a peer, when the configuration names a file
(``TransferConfig.audit_path``; None: no log)::

    audit = AuditLog("runs/audit.jsonl")
    audit.record_update(version=7, started_at=t0, finished_at=t1, reports=rank_reports,
                        integrity=result, outcome="ok", torn=[], replicas=["engine0"])
    audit.record_resync(version=7, source="engine0", target="engine1", started_at=t0,
                        finished_at=t1, pairs={("engine0/tp0", "engine1/tp0"): 4096},
                        outcome="ok")
    read_audit("runs/audit.jsonl")       # the records, as dicts, in order

Every line: ``kind`` (update or resync), ``version``, ``started_at`` and
``finished_at`` (Unix seconds), ``seconds``, ``bytes`` (total) and ``pairs``
(``[{"src": "trainer0", "dst": "engine0/tp1", "bytes": n}, ...]``: landed bytes
per source and destination rank), ``integrity`` (the checksum mode, ranges and
bytes compared, ok, mismatches; null where no check ran), ``outcome`` (``ok``
or ``failed``), ``torn`` (replicas left torn), ``error`` (the message, or null).

Append-safe: each record is one ``write`` of a whole line to a file opened
with ``O_APPEND`` (so lines of several writers never interleave), then
``fsync``; a failure to write the log is logged, never raised into an update.
:func:`audited_update` (on ``WeightTransferController.update``) records the
failures that end an update before it can record them itself (a pause that
failed, say).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def update_pairs(reports: Iterable[Any]) -> list[dict[str, Any]]:
    """Landed bytes per (trainer rank, engine rank) from RankReports' ``dest_bytes``."""
    return [{"src": f"trainer{r.rank}", "dst": dst, "bytes": int(n)}
            for r in sorted(reports, key=lambda r: r.rank)
            for dst, n in sorted(r.transfer.dest_bytes.items())]


class AuditLog:
    """Appends records to ``path`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise ValueError(f"audit_path {str(self.path)!r} is a directory, not a file")
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _append(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            log.error("audit log %s: could not append a %s record: %s", self.path,
                      record.get("kind"), err)

    def record_update(self, *, version: int, started_at: float, finished_at: float,
                      reports: Sequence[Any], outcome: str, torn: Sequence[str] = (),
                      integrity: Any = None, replicas: Sequence[str] = (),
                      error: str | None = None, retries: int | None = None) -> None:
        """One update (``reports``: the trainers' RankReports that came back)."""
        pairs = update_pairs(reports)
        self._append({
            "kind": "update", "version": version, "started_at": started_at,
            "finished_at": finished_at, "seconds": finished_at - started_at,
            "bytes": sum(p["bytes"] for p in pairs), "pairs": pairs,
            "integrity": None if integrity is None else integrity.as_dict(),
            "outcome": outcome, "torn": sorted(torn), "replicas": list(replicas),
            "retries": sum(r.transfer.retries for r in reports) if retries is None else retries,
            "error": error,
        })

    def record_resync(self, *, version: int | None, source: str, target: str,
                      started_at: float, finished_at: float,
                      pairs: Mapping[tuple[str, str], int], outcome: str,
                      integrity: Any = None, error: str | None = None) -> None:
        """One re-sync of replica ``target`` from peer ``source`` (``pairs``: bytes per
        (source rank, target rank), e.g. ``("engine0/tp0", "engine1/tp0")``)."""
        rows = [{"src": s, "dst": d, "bytes": int(n)} for (s, d), n in sorted(pairs.items())]
        self._append({
            "kind": "resync", "version": version, "source": source, "target": target,
            "started_at": started_at, "finished_at": finished_at,
            "seconds": finished_at - started_at, "bytes": sum(r["bytes"] for r in rows),
            "pairs": rows, "integrity": None if integrity is None else integrity.as_dict(),
            "outcome": outcome, "torn": [] if outcome == "ok" else [target], "error": error,
        })


def audited_update(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a controller's ``update(version, ...)``: an exception that the update did
    not record itself (a pause that failed, a timeout before any report) still leaves a
    ``failed`` line, when the controller has an ``audit`` log and got as far as attempting
    ``version`` (``_attempted``; a refused version number is not an update)."""

    @functools.wraps(method)
    def wrapper(self: Any, version: int, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        try:
            return method(self, version, *args, **kwargs)
        except Exception as err:
            audit = getattr(self, "audit", None)
            if (audit is not None and not getattr(err, "audited", False)
                    and getattr(self, "_attempted", None) == version):
                audit.record_update(version=version, started_at=started, finished_at=time.time(),
                                    reports=[], outcome="failed", torn=getattr(err, "torn", []),
                                    replicas=list(getattr(self, "replicas", ())),
                                    error=f"{type(err).__name__}: {err}")
            raise

    return wrapper


def read_audit(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of an audit log, in order (ValueError naming a line that is not JSON)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{i}: not a JSON line: {err}") from None
    return out


def now() -> float:
    """Wall-clock time as the audit records it (Unix seconds)."""
    return time.time()
