"""Checksums of written ranges: the policy's selection, the hash, and a real transfer whose
reported checksums equal the hashes of the engine memory the writes landed in."""

import asyncio
import inspect
import math

import numpy as np
import pytest
import torch
import xxhash
from test_executor import Setup

from actors.config import TransferConfig, TransferSettings
from actors.messages import RankOptions
from weight_transfer.integrity.checksums import (
    ADDR,
    CHECKSUM,
    LENGTH,
    OFFSET,
    TASK,
    ChecksumLog,
    IntegrityPolicy,
    checksum,
    checksum_ranges,
    merge_ranges,
)
from weight_transfer.sender.executor import RankTransfer


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.3, 0.1, 0.01])
def test_sample_mode_covers_every_range_once_over_its_period(fraction):
    policy = IntegrityPolicy(mode="sample", fraction=fraction)
    n = policy.period
    assert n == math.ceil(1 / fraction)
    tasks = range(1000)
    for first in (0, 1, 7, 123):  # any run of n consecutive versions
        seen = [sum(policy.selects(t, v) for v in range(first, first + n)) for t in tasks]
        assert seen == [1] * len(tasks)
    per_update = [sum(policy.selects(t, v) for t in tasks) for v in range(n)]
    assert all(abs(c - len(tasks) / n) <= 1 for c in per_update)  # the stated fraction


def test_off_selects_nothing_and_full_everything():
    off, full = IntegrityPolicy(mode="off"), IntegrityPolicy(mode="full")
    assert not any(off.selects(t, v) for t in range(50) for v in range(5))
    assert all(full.selects(t, v) for t in range(50) for v in range(5))
    assert not off.enabled and full.enabled and full.period == 1


@pytest.mark.parametrize("value,match", [
    ({"mode": "sometimes"}, r"^TransferConfig.integrity.mode: Input should be 'off', 'sample' "
                            r"or 'full' \(got 'sometimes'\)"),
    ({"mode": "sample", "fraction": 0},
     r"^TransferConfig.integrity.fraction: Input should be greater than 0 \(got 0\)"),
    ({"mode": "sample", "fraction": 1.5},
     r"integrity.fraction: .* less than or equal to 1 \(got 1.5\)"),
    ({"mode": "sample", "fraction": True}, r"integrity.fraction: .*valid number \(got True\)"),
    ({"mode": "full", "fraction": 0.5},
     r"^TransferConfig.integrity.fraction applies to mode 'sample' only \(mode is 'full'\)"),
    ({"mode": "full", "every": 2},
     r"^TransferConfig.integrity.every: Extra inputs are not permitted"),
    (3, r"^TransferConfig.integrity: Input should be a valid dictionary .* \(got 3\)"),
])
def test_a_bad_policy_is_refused_naming_the_field_and_the_value(value, match):
    with pytest.raises(ValueError, match=match):
        TransferConfig(integrity=value)


def test_a_mode_name_a_mapping_or_a_policy_is_accepted():
    assert TransferConfig(integrity="full").integrity == IntegrityPolicy(mode="full")
    assert TransferConfig(integrity={"fraction": 0.25}).integrity == IntegrityPolicy(
        mode="sample", fraction=0.25)
    p = IntegrityPolicy(mode="off")
    assert TransferConfig(integrity=p).integrity is p
    assert IntegrityPolicy.model_validate("full") == IntegrityPolicy(mode="full")
    with pytest.raises(ValueError, match=r"^IntegrityPolicy.mode: Input should be"):
        IntegrityPolicy(mode="sometimes")


def test_one_set_of_defaults_the_policys_own():
    default = IntegrityPolicy()
    assert (default.mode, default.fraction) == ("sample", 0.1)
    assert TransferSettings().integrity == RankOptions().integrity == default
    assert TransferSettings().rank_options().integrity == default
    assert inspect.signature(RankTransfer).parameters["integrity"].default == default


def test_checksum_is_xxh3_of_the_bytes_for_every_source_kind():
    data = bytes(range(256)) * 40
    want = xxhash.xxh3_64_intdigest(data)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert checksum(data) == checksum(t) == checksum(np.frombuffer(data, np.uint8)) == want
    assert checksum(t.view(torch.float32)) == want  # any dtype: its bytes
    assert checksum(t.view(torch.float8_e4m3fn)) == want
    assert checksum(t[:0]) == xxhash.xxh3_64_intdigest(b"")
    with pytest.raises(ValueError, match="non-contiguous"):
        checksum(t.view(torch.int32).reshape(40, 64)[:, ::2])


def test_checksum_ranges_reads_regions_by_address_and_refuses_outside():
    a = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    b = torch.zeros(100, dtype=torch.uint8)
    bufs = {1000: a, 9000: b}
    rows = np.array([[1000, 0, 16], [1000, 4000, 96], [9000, 10, 90]], dtype=np.uint64)
    got = checksum_ranges(bufs, rows)
    assert got.tolist() == [checksum(a[:16]), checksum(a[4000:4096]), checksum(b[10:100])]
    with pytest.raises(ValueError, match=r"range 0: no registered region at 0x1"):
        checksum_ranges(bufs, np.array([[1, 0, 1]], dtype=np.uint64))
    with pytest.raises(ValueError, match=r"range 1: 91 B at offset 10 is outside the 100 B"):
        checksum_ranges(bufs, np.array([[1000, 0, 1], [9000, 10, 91]], dtype=np.uint64))
    with pytest.raises(ValueError, match=r"integer array of \(addr, offset, length\) rows, "
                                         r"not uint64 of shape \(1, 4\)"):
        checksum_ranges(bufs, np.array([[1000, 0, 1, 1]], dtype=np.uint64))
    with pytest.raises(ValueError, match="not float64"):
        checksum_ranges(bufs, np.array([[1000.0, 0, 1]]))
    with pytest.raises(ValueError, match="negative"):
        checksum_ranges(bufs, np.array([[1000, -1, 1]]))


def test_log_groups_rows_by_engine_rank_and_merges_senders():
    a, b = ChecksumLog(), ChecksumLog()
    a.add(replica="engine0", rank=1, task=3, addr=10, offset=0, length=4, value=2**64 - 1)
    a.add(replica="engine0", rank=0, task=4, addr=20, offset=4, length=4, value=7)
    b.add(replica="engine0", rank=1, task=9, addr=10, offset=4, length=8, value=8)
    assert len(a) == 2
    merged = merge_ranges([*a.ranges(), *b.ranges()])
    assert sorted(merged) == [("engine0", 0), ("engine0", 1)]
    rows = merged[("engine0", 1)]
    assert rows[:, TASK].tolist() == [3, 9] and rows[:, CHECKSUM].tolist() == [2**64 - 1, 8]
    assert a.ranges()[1].nbytes == 4


@pytest.mark.parametrize("mode", ["full", "sample"])
def test_reported_checksums_match_the_engine_memory_they_landed_in(mode):
    s = Setup("tiny_llama", fp8=False)
    policy = IntegrityPolicy(mode=mode, **({"fraction": 0.25} if mode == "sample" else {}))
    try:
        reports = [asyncio.run(s.transfer(r.rank, watermark_bytes=8 << 20, integrity=policy)
                               .run(version=3)) for r in s.trainer_meta.ranks]
        tasks = {t.task_id: t for r in s.trainer_meta.ranks for t in s.plan.tasks_for(r.rank)}
        merged = merge_ranges([x for rep in reports for x in rep.checksums])
        hashed = sorted(int(t) for rows in merged.values() for t in rows[:, TASK])
        assert all(rep.hash_seconds > 0 for rep in reports if rep.checksums)
        assert hashed == sorted(t for t in tasks if policy.selects(t, 0))  # first run: turn 0
        for (replica, rank), rows in merged.items():
            buf = s.buffers[(replica, rank)]
            base = {e.tensors[0].region.addr for e in s.engines
                    if (e.replica, e.rank) == (replica, rank)}
            assert set(rows[:, ADDR].tolist()) <= base
            want = checksum_ranges({a: buf for a in base}, rows[:, ADDR:CHECKSUM])
            assert want.tolist() == rows[:, CHECKSUM].tolist()
            for row in rows.tolist():
                task = tasks[row[TASK]]
                assert (row[OFFSET], row[LENGTH]) == (task.region_offset, task.nbytes)
        dest = {}
        for rep in reports:
            for k, n in rep.dest_bytes.items():
                dest[k] = dest.get(k, 0) + n
        assert sum(dest.values()) == s.plan.bytes_total
        assert set(dest) == {f"{e.replica}/tp{e.rank}" for e in s.engines}
    finally:
        s.close()


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_sample_rotation_covers_every_range_in_n_updates_whatever_the_versions(fraction):
    """Versions 0, N, 2N, ...: keyed by version, every update would hash the same tasks
    (t + kN = t mod N); keyed by the sender's run count, N updates hash every task."""
    s = Setup("tiny_llama", fp8=False)
    policy = IntegrityPolicy(mode="sample", fraction=fraction)
    n = policy.period
    try:
        transfers = [s.transfer(r.rank, watermark_bytes=8 << 20, integrity=policy)
                     for r in s.trainer_meta.ranks]
        tasks = sorted(t.task_id for r in s.trainer_meta.ranks for t in s.plan.tasks_for(r.rank))
        per_update = []
        for k in range(n):
            reports = [asyncio.run(t.run(version=k * n)) for t in transfers]
            merged = merge_ranges([x for rep in reports for x in rep.checksums])
            per_update.append({int(t) for rows in merged.values() for t in rows[:, TASK]})
        assert sorted(set().union(*per_update)) == tasks  # every range within N updates
        assert sum(map(len, per_update)) == len(tasks)  # each once
        assert all(per_update)
        by_version = {t for t in tasks if (t + 0) % n == 0}  # what version keying hashed
        assert by_version != set(tasks)
    finally:
        s.close()


def test_off_reports_no_checksums():
    s = Setup("tiny_llama", fp8=False)
    try:
        rep = asyncio.run(s.transfer(0, integrity=IntegrityPolicy(mode="off")).run(version=1))
        assert rep.checksums == () and rep.bytes_written > 0 and rep.hash_seconds == 0
    finally:
        s.close()


class FakeEngine:
    """An engine rank's ``wt_checksum`` over its registered buffer, called in-process."""

    def __init__(self, meta, buf):
        self.bufs = {meta.tensors[0].region.addr: buf}

    def wt_checksum(self, rows):
        return checksum_ranges(self.bufs, rows)


def in_process(**kw):
    return dict(call=lambda method, *a: method(*a), get=lambda r: r, timeout_s=5,
                pending=lambda refs, t: [], **kw)


def test_verify_update_names_the_replica_rank_tensor_and_checksums_of_a_flipped_byte():
    from actors.controller.checks import verify_update
    from actors.reports import RankReport

    s = Setup("tiny_llama", fp8=False)
    try:
        policy = IntegrityPolicy(mode="full")
        reports = [RankReport(transfer=asyncio.run(
            s.transfer(r.rank, integrity=policy).run(version=1))) for r in s.trainer_meta.ranks]
        metas, actors = {}, {}
        for e in s.engines:
            metas.setdefault(e.replica, []).append(e)
            actors.setdefault(e.replica, []).append(FakeEngine(e, s.buffers[(e.replica, e.rank)]))
        clean = verify_update(policy=policy, reports=reports, replicas=actors, metas=metas,
                              **in_process())
        assert clean.ok and clean.ranges == s.plan.num_tasks
        assert clean.bytes == s.plan.bytes_total
        victim = metas["engine1"][1]
        tensor = victim.tensors[2]
        s.buffers[("engine1", 1)][tensor.offset + 5] ^= 0x01
        bad = verify_update(policy=policy, reports=reports, replicas=actors, metas=metas,
                            **in_process())
        assert bad.torn == ["engine1"] and len(bad.mismatches) == 1
        m = bad.mismatches[0]
        assert (m.replica, m.rank, m.tensor) == ("engine1", 1, tensor.name)
        assert m.tensor_offset <= 5 < m.tensor_offset + m.length
        assert m.actual != m.expected
        assert f"engine1/tp1 tensor '{tensor.name}'" in bad.message()
        # Only the replicas asked about are checked (a torn one is skipped).
        only0 = verify_update(policy=policy, reports=reports, replicas={"engine0": actors[
            "engine0"]}, metas=metas, **in_process())
        assert only0.ok and 0 < only0.ranges < clean.ranges
    finally:
        s.close()


def test_verify_copy_compares_whole_regions_with_the_source():
    from actors.controller.checks import verify_copy

    s = Setup("tiny_llama", fp8=False)
    try:
        asyncio.run(s.transfer(0).run(version=1))
        src = [e for e in s.engines if e.replica == "engine0"]
        dst = [e for e in s.engines if e.replica == "engine1"]
        for a, b in zip(src, dst, strict=True):  # a faithful copy of engine0 into engine1
            s.buffers[(b.replica, b.rank)].copy_(s.buffers[(a.replica, a.rank)])
        make = [[FakeEngine(e, s.buffers[(e.replica, e.rank)]) for e in g] for g in (src, dst)]
        kw = in_process(source=make[0], target=make[1], source_metas=src, target_metas=dst)
        assert verify_copy(**kw).ok
        s.buffers[("engine1", 0)][-1] ^= 0xFF
        bad = verify_copy(**kw)
        assert [(m.replica, m.rank, m.task) for m in bad.mismatches] == [("engine1", 0, -1)]
    finally:
        s.close()
