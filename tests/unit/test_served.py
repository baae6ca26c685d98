"""Checksums of served memory (weight_transfer.integrity.served): the engine-side chunks cover every
tensor byte, the background rotation covers every row within ceil(bytes / budget) ticks, a
peer copy moves a reference to the target's addresses, and the audit line of a check."""

import json
import math
import threading
import time

import numpy as np
import pytest
import torch
from test_executor import Setup

from actors.controller.audit import CheckAudit, open_audit, read_audit
from actors.controller.checks import IntegrityResult, Mismatch
from actors.controller.served import BackgroundCheck
from weight_transfer.integrity.checksums import (
    ADDR,
    CHECKSUM,
    LENGTH,
    NO_TASK,
    OFFSET,
    TASK,
    checksum_ranges,
)
from weight_transfer.integrity.served import (
    ServedBook,
    ServedSums,
    region_maps,
    rotate,
    tensor_chunks,
)


@pytest.fixture(scope="module")
def setup():
    s = Setup("tiny_llama", fp8=False)
    yield s
    s.close()


def test_tensor_chunks_cover_every_tensor_byte_once(setup):
    for meta in setup.engines:
        rows = tensor_chunks(meta, chunk_bytes=1000)
        assert (rows[:, TASK] == NO_TASK).all() and (rows[:, LENGTH] <= 1000).all()
        covered = np.zeros(meta.tensors[0].region.length, dtype=np.int64)
        for _t, _a, off, length, _c in rows.tolist():
            covered[off:off + length] += 1
        want = np.zeros_like(covered)
        for t in meta.tensors:
            want[t.offset:t.offset + t.nbytes] = 1
        assert np.array_equal(covered, want)
    with pytest.raises(ValueError, match="chunk_bytes"):
        tensor_chunks(setup.engines[0], chunk_bytes=0)


@pytest.mark.parametrize("budget", [1, 7, 50, 10**9])
def test_rotate_takes_consecutive_rows_up_to_the_budget_and_wraps(budget):
    lengths = np.array([10, 20, 5, 30, 1], dtype=np.uint64)
    start, seen = 3, []
    for _ in range(len(lengths)):
        idx, start = rotate(lengths, start, budget)
        assert len(idx) >= 1
        assert lengths[idx[:-1]].sum() < budget  # stops at the row that reaches the budget
        seen += idx.tolist()
    assert set(seen) == set(range(len(lengths)))
    assert rotate(np.empty(0, dtype=np.uint64), 4, 10)[0].size == 0


def _sums(version, sizes, *, addr=0x1000):
    ranks = []
    for n in sizes:
        rows = np.zeros((n, 5), dtype=np.uint64)
        rows[:, ADDR], rows[:, OFFSET] = addr, np.arange(n) * 100
        rows[:, LENGTH], rows[:, CHECKSUM] = 100, np.arange(n) + version
        ranks.append(rows)
    return ServedSums(version=version, source="trainers", ranks=tuple(ranks))


def test_ticks_cover_every_row_of_every_replica_within_ceil_bytes_over_budget():
    book = ServedBook()
    book.record("engine0", _sums(3, [4, 6]))
    book.record("engine1", _sums(3, [5, 5]))
    total = sum(book.get(n).nbytes for n in book.replicas())
    budget = 300
    seen = []
    for _ in range(math.ceil(total / budget)):
        for (name, rank), rows in book.tick(budget_bytes=budget,
                                            replicas=["engine0", "engine1"]).items():
            seen += [(name, rank, int(o)) for o in rows[:, OFFSET]]
    want = [(n, r, int(o)) for n in book.replicas() for r, rows in enumerate(book.get(n).ranks)
            for o in rows[:, OFFSET]]
    assert set(seen) == set(want)  # every row; the last tick may wrap to the first rows
    assert len(seen) - len(want) < budget // 100
    only = book.tick(budget_bytes=10**9, replicas=["engine1"])
    assert {k[0] for k in only} == {"engine1"} and sum(map(len, only.values())) == 10
    assert book.tick(budget_bytes=100, replicas=["engine9"]) == {}
    assert set(book.all_rows(["engine0"])) == {("engine0", 0), ("engine0", 1)}


def test_a_peer_copy_moves_the_reference_to_the_targets_addresses(setup):
    src = [m for m in setup.engines if m.replica == "engine0"]
    dst = [m for m in setup.engines if m.replica == "engine1"] or src
    maps = region_maps(src, dst)
    book = ServedBook()
    book.record("engine0", ServedSums(version=2, source="engine",
                                      ranks=tuple(tensor_chunks(m) for m in src)))
    assert book.copy("engine0", "engine1", addr_maps=maps)
    copied = book.get("engine1")
    assert copied.version == 2 and copied.nbytes == book.get("engine0").nbytes
    for rows, m in zip(copied.ranks, dst, strict=True):
        assert set(rows[:, ADDR].tolist()) == {t.region.addr for t in m.tensors}
    assert not book.copy("engine7", "engine1", addr_maps=maps)  # no reference: dropped
    assert "engine1" not in book
    with pytest.raises(ValueError, match="region map"):
        book.copy("engine0", "engine1", addr_maps=[{}] * len(maps))


def test_engine_chunks_hash_as_the_memory_and_a_flipped_byte_shows(setup):
    meta = setup.engines[0]
    buf = setup.buffers[(meta.replica, meta.rank)]
    torch.manual_seed(0)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    rows = tensor_chunks(meta, chunk_bytes=4096)
    regions = {meta.tensors[0].region.addr: buf}
    rows[:, CHECKSUM] = checksum_ranges(regions, rows[:, ADDR:CHECKSUM])
    t = meta.tensors[2]
    buf[t.offset + 5000] ^= 0xFF
    got = checksum_ranges(regions, rows[:, ADDR:CHECKSUM])
    (bad,) = np.flatnonzero(got != rows[:, CHECKSUM]).tolist()
    assert rows[bad, OFFSET] <= t.offset + 5000 < rows[bad, OFFSET] + rows[bad, LENGTH]


def test_served_sums_refuse_bad_rows_and_sources():
    with pytest.raises(ValueError, match="source"):
        ServedSums(version=1, source="nobody", ranks=())
    with pytest.raises(ValueError, match=r"rows must be \[n, 5\]"):
        ServedSums(version=1, source="engine", ranks=(np.zeros((2, 3), dtype=np.uint64),))


def test_a_check_leaves_one_audit_line(tmp_path):
    bad = Mismatch(replica="engine1", rank=1, tensor="w", tensor_offset=64, length=4096,
                   task=-1, expected=1, actual=2)
    result = IntegrityResult(mode="served-full", ranges=10, bytes=40960, seconds=0.1,
                             mismatches=(bad,))
    audit = open_audit(tmp_path / "audit.jsonl")
    audit.record(CheckAudit(mode="full", started_at=1.0, finished_at=2.5,
                            versions={"engine1": 4, "engine0": 4}, integrity=result,
                            bad=("engine1",), healed=("engine1",)))
    (line,) = read_audit(tmp_path / "audit.jsonl")
    assert line["kind"] == "check" and line["outcome"] == "failed" and line["seconds"] == 1.5
    assert line["bad"] == ["engine1"] and line["healed"] == ["engine1"] and line["torn"] == []
    assert line["versions"] == {"engine0": 4, "engine1": 4}
    assert line["integrity"]["mismatches"] == [
        "engine1/tp1 tensor 'w' bytes [64, 4160): xxh3_64 expected 0x0000000000000001, "
        "engine holds 0x0000000000000002"]
    json.dumps(line)


def _until(cond, bound_s=30.0):
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached within the bound"
        time.sleep(0.005)


def test_the_background_check_skips_ticks_while_the_lock_is_held():
    lock, calls = threading.RLock(), []
    watch = BackgroundCheck(lambda: calls.append(1), interval_s=0.01, lock=lock)
    with lock:  # an update in flight
        watch.start()
        _until(lambda: watch.skipped >= 3)
        assert calls == [] and watch.ticks == 0
    _until(lambda: watch.ticks >= 2)
    watch.stop()
    n = len(calls)
    assert n == watch.ticks and not watch._thread.is_alive()
    with pytest.raises(ValueError, match="integrity_watch_s"):
        BackgroundCheck(lambda: None, interval_s=0, lock=lock)
