"""Shadow mode's pure parts: what the shadow holds, the chunked swap, the fenced commands."""

from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest
import torch

from weight_transfer.engines.fence import CommandFence
from weight_transfer.engines.registered import RegisteredMemory
from weight_transfer.engines.shadow.rank import ShadowControl
from weight_transfer.engines.shadow.store import (
    Holds,
    ShadowCopy,
    ShadowError,
    ShadowState,
    swap_chunked,
)
from weight_transfer.integrity.checksums import checksum
from weight_transfer.transport.options import DEFAULT_TRANSPORT
from weight_transfer.types import ShardSpec


def test_flip_keeps_the_previous_version_and_rollback_returns_to_it():
    s = ShadowState("engine0/tp1")
    s.stage(1)
    s.flip(1, live=None)  # nothing served before: nothing to roll back to
    assert (s.holds, s.version) == (Holds.EMPTY, None)
    with pytest.raises(ShadowError, match="engine0/tp1: no previous version"):
        s.check_rollback()
    s.stage(2)
    s.flip(2, live=1)
    assert (s.holds, s.version) == (Holds.PREVIOUS, 1)
    assert s.rollback(live=2) == 1
    assert (s.holds, s.version) == (Holds.UNDONE, 2)
    with pytest.raises(ShadowError, match="rolled back from"):  # not a second rollback
        s.rollback(live=1)


@pytest.mark.parametrize("holds", ["empty", "writing 3", "previous"])
def test_a_flip_to_a_version_never_staged_is_refused_and_changes_nothing(holds):
    s = ShadowState("engine1/tp0")
    if holds == "writing 3":
        s.stage(3)
    elif holds == "previous":
        s.stage(2)
        s.flip(2, live=1)
    before = (s.holds, s.version)
    with pytest.raises(ShadowError, match="flip to version 4 refused: the shadow holds"):
        s.flip(4, live=7)
    assert (s.holds, s.version) == before


def test_a_failed_transfer_drops_the_previous_version_and_discard_is_idempotent():
    s = ShadowState("e")
    s.stage(2)
    s.flip(2, live=1)
    s.stage(3)  # the transfer overwrites what the shadow held
    with pytest.raises(ShadowError, match="being written"):
        s.check_rollback()
    assert s.discard() is True
    assert s.discard() is False
    assert (s.holds, s.version) == (Holds.EMPTY, None)


@pytest.mark.parametrize("n,chunk", [(1, 1), (1000, 7), (4096, 4096), (5000, 8192)])
def test_swap_chunked_swaps_every_byte(n, chunk):
    g = torch.Generator().manual_seed(n)
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    a0, b0 = a.clone(), b.clone()
    assert swap_chunked(a, b, torch.empty(chunk, dtype=torch.uint8)) == n
    assert torch.equal(a, b0) and torch.equal(b, a0)


def test_swap_refuses_mismatched_buffers():
    with pytest.raises(ValueError, match="sizes differ"):
        swap_chunked(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8),
                     torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="flat uint8"):
        swap_chunked(torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.uint8))


def test_shadow_error_is_a_value_error_that_pickles():
    err = pickle.loads(pickle.dumps(ShadowError("engine0/tp0: no previous version")))
    assert isinstance(err, ValueError) and "no previous version" in str(err)


class Boundary:
    """A pause point like the reference adapter's: a step runs while ``busy``."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.busy = False
        self.paused = 0
        self.log: list[str] = []

    def pause(self) -> None:
        with self.cond:
            self.paused += 1
            self.log.append("pause")

    def resume(self) -> None:
        with self.cond:
            self.paused -= 1
            self.log.append("resume")
            self.cond.notify_all()

    def wait_idle(self, timeout=None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.busy, timeout)


def rank(nbytes=3000, chunk=1024):
    live = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    shadow = torch.zeros(nbytes, dtype=torch.uint8)
    entries = [("w", (nbytes,), "uint8", 0)]
    fence, mem, boundary = CommandFence("engine0/tp0"), RegisteredMemory("engine0/tp0"), Boundary()
    ctl = ShadowControl("engine0/tp0", "test", fence=fence, mem=mem, boundary=boundary)
    ctl.copy = ShadowCopy("engine0/tp0", "test", live=[(live, entries)],
                          shadow=[(shadow, entries)], chunk_bytes=chunk)
    mem.register(DEFAULT_TRANSPORT, ctl.copy.region_buffers(), nic_names=["inode0/nic0"],
                 node="node", address="127.0.0.1", replica="engine0", rank=0,
                 shard=ShardSpec(tp_rank=0, tp_size=1))  # the NIC exposes the shadow
    ctl.bind()
    return ctl, live, shadow, fence, boundary


def test_flip_swaps_at_a_boundary_and_rollback_restores_the_previous_bytes_exactly():
    ctl, live, shadow, fence, boundary = rank()
    old = live.clone()
    fence.version = 1

    assert ctl.stage(2, epoch=10)
    shadow.copy_(torch.full_like(shadow, 7))  # the transfer's writes
    region = ctl.mem.meta.tensors[0].region
    assert region.addr == shadow.data_ptr()
    row = np.array([[region.addr, 0, 3000]], dtype=np.uint64)
    assert ctl.mem.checksum(row)[0] == checksum(torch.full_like(shadow, 7))
    assert ctl.live_checksum(row)[0] == checksum(old)  # serving the old bytes meanwhile
    assert ctl.flip(2, epoch=11, deadline=None)
    assert fence.version == 2 and torch.equal(live, torch.full_like(live, 7))
    assert torch.equal(shadow, old) and boundary.log == ["pause", "resume"]
    assert ctl.rollback(epoch=12, deadline=None)
    assert fence.version == 1 and torch.equal(live, old)
    with pytest.raises(ShadowError, match="no previous version"):
        ctl.rollback(epoch=13, deadline=None)
    assert fence.version == 1 and torch.equal(live, old)


def test_stale_and_late_flips_are_refused_and_a_failed_transfer_leaves_live_untouched():
    ctl, live, shadow, fence, _ = rank()
    old = live.clone()
    fence.version = 1
    assert ctl.stage(2, epoch=20)
    shadow.fill_(9)
    assert not ctl.flip(2, epoch=19, deadline=None)  # stale
    assert not ctl.flip(2, epoch=21, deadline=time.time() - 1)  # late
    assert ctl.discard(epoch=22)
    with pytest.raises(ShadowError, match="flip to version 2 refused"):
        ctl.flip(2, epoch=23, deadline=None)
    assert fence.version == 1 and torch.equal(live, old)


def test_a_flip_waits_for_the_step_that_runs():
    ctl, live, shadow, fence, boundary = rank()
    ctl.stage(5, epoch=1)
    shadow.fill_(3)
    boundary.busy = True
    done = threading.Event()
    t = threading.Thread(target=lambda: (ctl.flip(5, epoch=2, deadline=None), done.set()))
    t.start()
    assert not done.wait(0.2)
    assert int(live[0]) == 0  # not swapped while the step reads it
    with boundary.cond:
        boundary.busy = False
        boundary.cond.notify_all()
    assert done.wait(5)
    t.join()
    assert int(live[0]) == 3 and fence.version == 5


def test_a_delta_stage_copies_live_into_the_shadow_and_names_it_as_the_base():
    ctl, live, shadow, fence, boundary = rank()
    fence.version = 4
    shadow.fill_(1)  # what an earlier flip left there: the version before
    assert ctl.stage(5, epoch=1, base=True)
    assert torch.equal(shadow, live) and ctl.copy.state.base == 4
    assert boundary.log == []  # served throughout: no pause
    assert ctl.info().last_sync_s > 0

    def apply(base, buffers):  # what the delta apply is given
        assert next(iter(buffers.values())).data_ptr() == shadow.data_ptr()  # never live
        buffers[next(iter(buffers))][:10] = 200
        return base

    assert ctl.apply_delta(5, apply) == 4
    assert int(shadow[0]) == 200 and int(live[0]) == 0
    with pytest.raises(ShadowError, match="delta records of version 6 refused"):
        ctl.apply_delta(6, apply)
    assert ctl.flip(5, epoch=2, deadline=None)
    assert int(live[0]) == 200 and ctl.copy.state.base is None
    with pytest.raises(ShadowError, match="delta records of version 5 refused: the shadow "
                                          "holds version 4, the previous one"):
        ctl.apply_delta(5, apply)


def test_a_dense_stage_names_no_base_and_copies_nothing():
    ctl, _live, shadow, fence, _ = rank()
    fence.version = 4
    assert ctl.stage(5, epoch=1)
    assert ctl.copy.state.base is None and int(shadow.sum()) == 0
    assert ctl.apply_delta(5, lambda base, buffers: base) is None  # every record refused
    assert ctl.discard(epoch=2) and ctl.copy.state.base is None


def test_the_reference_rank_implements_the_shadow_contract_with_its_parameters():
    import inspect

    from actors.inference import InferenceMixin
    from weight_transfer.engines.rank import SHADOW_RANK_METHODS, ShadowEngineRank, method_name

    assert {"wt_stage", "wt_flip", "wt_rollback", "wt_discard_shadow"} <= SHADOW_RANK_METHODS
    for name in SHADOW_RANK_METHODS:
        want = list(inspect.signature(getattr(ShadowEngineRank, name)).parameters)
        got = [p for p in inspect.signature(getattr(InferenceMixin, name)).parameters
               if p != "_ray_trace_ctx"]  # added by ray.remote's tracing wrapper
        assert got == want, name
        assert method_name(getattr(ShadowEngineRank, name)) == name
