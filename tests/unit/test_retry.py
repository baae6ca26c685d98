"""Retries of transient WRITE errors: the policy, a link flap ridden out by a real transfer,
a link that stays down reported naming NIC, peer and region, and permanent errors that are
never retried."""

import asyncio
import inspect

import pytest
import torch
from test_executor import Setup

from actors.config import TransferConfig, TransferSettings
from actors.messages import RankOptions
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.sender.executor import RankTransfer
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.sender.retry import RetryingWriter, RetryPolicy
from weight_transfer.transport.base import (
    LinkDownError,
    RemoteAccessError,
    RetriesExhaustedError,
    TransientTransportError,
    TransportBase,
)


def test_policy_delays_grow_and_are_capped():
    p = RetryPolicy(attempts=5, backoff_s=0.1, backoff_factor=3.0, max_backoff_s=0.5)
    assert p.delays() == pytest.approx([0.1, 0.3, 0.5, 0.5])
    assert RetryPolicy(attempts=1).delays() == []
    assert RetryPolicy().delays() == pytest.approx([0.05, 0.1, 0.2])


@pytest.mark.parametrize("value,match", [
    ({"attempts": 0},
     r"^TransferConfig.retry.attempts: Input should be greater than or equal to 1 \(got 0\)"),
    ({"attempts": 101}, r"^TransferConfig.retry.attempts: .*less than or equal to 100"),
    ({"attempts": 2.5}, r"retry.attempts: Input should be a valid integer \(got 2.5\)"),
    ({"attempts": True}, r"retry.attempts: Input should be a valid integer \(got True\)"),
    ({"backoff_s": -1}, r"retry.backoff_s: Input should be greater than or equal to 0"),
    ({"backoff_factor": 0.5}, r"retry.backoff_factor: Input should be greater than or equal to 1"),
    ({"max_backoff_s": float("inf")}, r"retry.max_backoff_s: Input should be a finite number"),
    ({"tries": 3}, r"^TransferConfig.retry.tries: Extra inputs are not permitted \(got 3\)"),
    ("3", r"^TransferConfig.retry: Input should be a valid dictionary .* \(got '3'\)"),
])
def test_a_bad_policy_is_refused_naming_the_field_and_the_value(value, match):
    with pytest.raises(ValueError, match=match):
        TransferConfig(retry=value)


def test_one_set_of_defaults_the_policys_own():
    default = RetryPolicy()
    assert default.attempts == 4 and TransferConfig(retry={"attempts": 2}).retry.attempts == 2
    assert TransferSettings().retry == RankOptions().retry == default
    assert TransferSettings().rank_options().retry == default
    assert inspect.signature(RankTransfer).parameters["retry"].default == default


def test_link_down_is_transient_and_still_a_peer_unreachable_error():
    assert issubclass(LinkDownError, TransientTransportError)
    assert not issubclass(RemoteAccessError, TransientTransportError)


def engine_matches_reference(s):
    for e in s.engines:
        want = load_engine_shard(s.cfg, s.state, e.shard, fp8=False)
        got = s.engine_bytes(e)
        if any(not torch.equal(got[n], as_bytes(want[n])) for n in want):
            return False
    return True


def run_all(s, **kw):
    return [asyncio.run(s.transfer(r.rank, watermark_bytes=8 << 20, **kw).run(version=1))
            for r in s.trainer_meta.ranks]


def test_a_link_flap_during_the_transfer_is_ridden_out_and_counted():
    s = Setup("tiny_llama", fp8=False)
    policy = RetryPolicy(attempts=8, backoff_s=0.02, max_backoff_s=0.2)  # ~0.9 s of patience
    try:
        s.writer.flap_link(0.15)  # down from the first write on, for 0.15 s
        reports = run_all(s, retry=policy)
        assert reports[0].retries > 0
        assert sum(r.bytes_written for r in reports) == s.plan.bytes_total
        assert engine_matches_reference(s)
    finally:
        s.close()


def test_a_link_that_stays_down_is_reported_naming_nic_peer_and_region():
    s = Setup("tiny_llama", fp8=False)
    failed = []
    try:
        s.writer.set_link(False)
        rep = asyncio.run(s.transfer(0, retry=RetryPolicy(attempts=3, backoff_s=0.01),
                                     on_write_error=lambda t, e: failed.append((t, e))).run(1))
        tasks = s.plan.tasks_for(0)
        assert rep.bytes_written == 0 and len(failed) == len(tasks)
        assert all(isinstance(e, RetriesExhaustedError) for _, e in failed)
        assert isinstance(failed[0][1].__cause__, LinkDownError)
        task, err = failed[0]
        msg = str(err)
        assert "NIC trainers/trainer-nic" in msg
        assert f"peer {task.region.owner}/{task.region.nic}" in msg
        assert f"rkey={task.region.rkey:#x}" in msg and "link of NIC trainers/trainer-nic" in msg
        assert any("failed 3 tries" in str(e) for _, e in failed)
        # One backoff sequence per peer NIC, not one per WRITE.
        peers = {(t.region.owner, t.region.nic) for t in tasks}
        assert rep.retries <= 2 * len(peers) < len(tasks)
    finally:
        s.close()


def test_permanent_errors_are_not_retried():
    s = Setup("tiny_llama", fp8=False)
    failed = []
    try:
        for e in s.engines:  # revoke every engine region: RemoteAccessError
            region = e.tensors[0].region
            s.targets[region.nic].deregister(region)
        rep = asyncio.run(s.transfer(0, retry=RetryPolicy(attempts=5, backoff_s=0.01),
                                     on_write_error=lambda t, e: failed.append(e)).run(1))
        assert failed and all(isinstance(e, RemoteAccessError) for e in failed)
        assert rep.retries == 0
    finally:
        s.close()


def test_writer_counts_retries_of_one_write():
    calls = []

    class Flaky(TransportBase):
        kind = "flaky"

        async def write(self, src, dst, off):
            calls.append(off)
            if len(calls) < 3:
                raise LinkDownError("link of NIC w/n0 is down")

    s = Setup("tiny_llama", fp8=False)
    try:
        region = s.engines[0].tensors[0].region
        w = RetryingWriter(Flaky(owner="w", nic="n0"), RetryPolicy(attempts=3, backoff_s=0.0))
        asyncio.run(w.write(b"abcd", region, 8))
        assert calls == [8, 8, 8] and w.retries == 2
    finally:
        s.close()
