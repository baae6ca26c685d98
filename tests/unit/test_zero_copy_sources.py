"""Zero-copy sources: pieces written straight from registered trainer memory, the fence
that keeps the optimizer step off them until the writes complete, snapshots instead
when an update would overlap a step, and sources that moved refused and staged."""

import asyncio
import contextlib
import logging
import threading
import time

import pytest
import torch
from test_executor import Setup

from actors.config import TransferSettings
from actors.controller.schedule_actor import summarize
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.layout.zero_copy import contiguous_span, zero_copy_span
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.sender.zero_copy.fence import StepFence
from weight_transfer.transport.simnic.nic import SimNic
from weight_transfer.types import MeshDesc, ParamMeta, Piece, Placement, Transform

S0, S1 = Placement(kind="shard", dim=0), Placement(kind="shard", dim=1)


@pytest.mark.parametrize("rect,shape,want", [
    (((0, 6), (0, 8)), (6, 8), (0, 48)),          # the whole tensor
    (((2, 4), (0, 8)), (6, 8), (16, 32)),         # whole rows
    (((2, 4), (0, 4)), (6, 8), None),             # half rows: strided
    (((3, 4), (2, 6)), (6, 8), (26, 30)),         # part of one row
    (((1, 2), (0, 2), (0, 4)), (3, 2, 4), (8, 16)),  # one whole matrix of a stack
    (((0, 3), (1, 2), (0, 4)), (3, 2, 4), None),  # one row of every matrix
    (((2, 2), (0, 8)), (6, 8), None),             # empty
])
def test_contiguous_span(rect, shape, want):
    assert contiguous_span(rect, shape) == want


def _meta(placements, dtype="bfloat16"):
    return ParamMeta(name="w", shape=(8, 16), dtype=dtype,
                     mesh=MeshDesc(ranks=(0, 1), shape=(2,), dim_names=("dp",)),
                     placements=placements)


def _piece(rect, *, dtype="bfloat16", transform=Transform.COPY):
    n = (rect[0][1] - rect[0][0]) * (rect[1][1] - rect[1][0])
    return Piece(dst_tensor="t", dst_offset=0, nbytes=2 * n, dst_dtype=dtype, src_param="w",
                 src_slice=rect, transform=transform)


@pytest.mark.parametrize("placements,rank,rect,kw,want", [
    ((S0,), 1, ((4, 6), (0, 16)), {}, (0, 32)),        # rows of rank 1's block
    ((S0,), 0, ((4, 6), (0, 16)), {}, None),           # not in rank 0's block
    ((S1,), 0, ((2, 4), (0, 8)), {}, (16, 32)),        # rows of a column block: contiguous
    ((S1,), 0, ((2, 4), (0, 4)), {}, None),            # a strided cut of it
    ((S0,), 0, ((0, 2), (0, 16)), {"dtype": "float32"}, None),  # a cast
    ((S0,), 0, ((0, 2), (0, 16)), {"transform": Transform.FP8_WEIGHT}, None),
])
def test_zero_copy_span_marks_only_untransformed_contiguous_own_bytes(placements, rank, rect,
                                                                      kw, want):
    assert zero_copy_span(_meta(placements), _piece(rect, **kw), rank) == want


def test_plan_summary_splits_zero_copy_and_staged_bytes():
    s = Setup("tiny_llama", fp8=False)
    try:
        summary = summarize(s.plan, plan_id=1, seconds=0.0, expert_naming="per_expert")
        assert 0 < summary.zero_copy_bytes <= summary.direct_bytes
        assert summary.zero_copy_bytes + summary.staged_bytes == summary.bytes_total
    finally:
        s.close()
    s = Setup("tiny_moe", fp8=True)  # FP8 pieces are never zero-copy
    try:
        summary = summarize(s.plan, plan_id=1, seconds=0.0, expert_naming="per_expert")
        assert summary.staged_bytes > summary.bytes_total // 2
    finally:
        s.close()


@contextlib.contextmanager
def _ranks(*, bandwidth_gbps=None, **kw):
    """tiny_llama's plan over simnic engines, and one RankTransfer per trainer rank."""
    s = Setup("tiny_llama", fp8=False, bandwidth_gbps=bandwidth_gbps)
    transfers = [s.transfer(r.rank, **kw) for r in s.trainer_meta.ranks]
    try:
        yield s, transfers
    finally:
        for t in transfers:
            t.close()
        s.close()


def _run_ranks(s, transfers, version, **kw):
    async def run_all():  # concurrently: one fence holds off the step until every rank is done
        return await asyncio.gather(*(t.run(version=version, **kw) for t in transfers))

    return asyncio.run(run_all())


def _check_engines(s, state):
    for e in s.engines:
        want = load_engine_shard(s.cfg, state, e.shard, fp8=False)
        got = s.engine_bytes(e)
        for name, ref in want.items():
            assert torch.equal(got[name], as_bytes(ref)), (e.replica, e.rank, name)


@pytest.mark.parametrize("source,overlap,want", [
    ("zero_copy", False, "zero_copy"), ("auto", False, "zero_copy"),
    ("auto", True, "snapshot"), ("snapshot", False, "snapshot"),
])
def test_each_update_says_what_it_wrote_from(source, overlap, want):
    with _ranks(source=source) as (s, transfers):
        reports = _run_ranks(s, transfers, 1, overlap=overlap)
        _check_engines(s, s.state)
        assert {r.source for r in reports} == {want}
        zero = sum(r.zero_copy_bytes for r in reports)
        planned = int(s.plan.task_nbytes()[s.plan.task_zero_copy()].sum())
        assert zero == (planned if want == "zero_copy" else 0)
        if want == "zero_copy":  # the NIC read them from the registered parameters
            assert s.writer.source_table.source_bytes >= zero > 0
            starts = {a for a, _ in s.writer.source_table.ranges()}
            assert s.state["model.embed_tokens.weight"].data_ptr() in starts
    assert s.writer.source_table.ranges() == []  # closing the transfers dropped every source


def test_zero_copy_pieces_hold_no_watermark_bytes():
    peaks = {}
    for source in ("zero_copy", "snapshot"):
        with _ranks(source=source) as (s, transfers):
            peaks[source] = max(r.watermark_peak for r in _run_ranks(s, transfers, 1))
    assert peaks["zero_copy"] < peaks["snapshot"]


def test_a_step_during_a_zero_copy_update_waits_and_the_pre_step_bytes_land():
    fence = StepFence(label="trainer")
    stepped = {}

    def step(state):
        while not fence.held:
            time.sleep(0.001)
        stepped["asked"] = time.perf_counter()
        with fence.step(timeout_s=30):
            stepped["ran"] = time.perf_counter()
            for t in state.values():
                t.add_(1.0)  # the optimizer changes every source in place

    # ~4 MB at 0.02 GB/s: about 0.2 s of writes
    with _ranks(bandwidth_gbps=0.02, source="zero_copy", fence=fence) as (s, transfers):
        before = {n: t.clone() for n, t in s.state.items()}
        thread = threading.Thread(target=step, args=(s.state,))
        thread.start()
        start = time.perf_counter()
        reports = _run_ranks(s, transfers, 1)
        done = time.perf_counter()
        thread.join(30)
        assert {r.source for r in reports} == {"zero_copy"}
        assert sum(r.zero_copy_bytes for r in reports) > 0
        assert fence.waited == 1 and stepped["ran"] >= done - 0.05 > start
        assert stepped["ran"] - stepped["asked"] > 0.05  # it did wait for the writes
        _check_engines(s, before)
        # the step ran while no update held the fence: the next update sees it
        assert fence.busy is False
        _run_ranks(s, transfers, 2)
        _check_engines(s, s.state)


def test_auto_snapshots_when_a_step_is_in_flight_and_waits_for_it():
    fence = StepFence(label="trainer")
    entered, finish = threading.Event(), threading.Event()

    def step(state):
        with fence.step(timeout_s=30):
            entered.set()
            finish.wait(5)
            for t in state.values():
                t.mul_(2.0)

    with _ranks(fence=fence) as (s, transfers):
        thread = threading.Thread(target=step, args=(s.state,))
        thread.start()
        entered.wait(5)
        threading.Timer(0.2, finish.set).start()
        reports = _run_ranks(s, transfers, 1)
        thread.join(5)
        assert {r.source for r in reports} == {"snapshot"}
        _check_engines(s, s.state)  # read only once the step was over: the stepped weights


def test_a_source_that_moved_is_refused_by_name_and_staged(caplog):
    name = "model.embed_tokens.weight"
    with _ranks(source="zero_copy") as (s, transfers):
        for t in transfers:
            t.register_sources()
        first = sum(r.zero_copy_bytes for r in _run_ranks(s, transfers, 1))
        old = s.state[name]
        s.state[name] = old.clone() * 3  # re-allocated (an optimizer change), new values
        old.fill_(float("nan"))  # a write that still read the old memory would land NaNs
        del old
        with caplog.at_level(logging.WARNING, logger="weight_transfer.sender.zero_copy.sources"):
            reports = _run_ranks(s, transfers, 2)
        assert all(r.sources_refused == (name,) for r in reports)  # every rank holds a block
        assert f"parameter {name!r} moved" in caplog.text
        assert sum(r.zero_copy_bytes for r in reports) < first
        _check_engines(s, s.state)
        # registered again at its new address: zero-copy from the next update on
        reports = _run_ranks(s, transfers, 3)
        assert all(r.sources_refused == () for r in reports)
        assert sum(r.zero_copy_bytes for r in reports) == first
        _check_engines(s, s.state)



def test_fence_hold_waits_for_the_step_and_times_out_naming_the_trainer():
    fence = StepFence(label="trainer rank 3")
    fence.hold()
    with pytest.raises(TimeoutError, match="trainer rank 3: the optimizer step waited"), \
            fence.step(timeout_s=0.05):
        pass
    fence.release()
    with pytest.raises(RuntimeError, match="released more often than held"):
        fence.release()
    with fence.step(), pytest.raises(TimeoutError, match="the weight update waited"):
        fence.hold(timeout_s=0.05)
    fence.hold(timeout_s=1)
    fence.release()


def test_simnic_keeps_a_table_of_sources():
    nic = SimNic(owner="t", nic="n0")
    try:
        buf = torch.zeros(64, dtype=torch.uint8)
        handle = nic.register_source(buf)
        assert nic.source_table.ranges() == [(buf.data_ptr(), 64)]
        nic.deregister_source(handle)
        with pytest.raises(ValueError, match="no source registration"):
            nic.deregister_source(handle)
    finally:
        nic.close()


def test_source_mode_is_checked_in_the_config():
    assert TransferSettings().source == "auto"
    with pytest.raises(ValueError, match="source"):
        TransferSettings(source="zerocopy")
