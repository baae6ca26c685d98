"""vLLM shadow mode without vLLM: the worker's memory moves (direct copy, standby swap) and the
replica's command logic (one action per command for all TP ranks, refusals that change
nothing). The real engine runs in tests/integration/test_vllm_shadow*.py."""

from __future__ import annotations

import pytest
import torch

from actors.vllm.shadow import VllmShadow
from weight_transfer.engines.fence import CommandFence
from weight_transfer.engines.shadow.store import ShadowError
from weight_transfer.engines.vllm import shadow as vshadow
from weight_transfer.types import TensorSpec


def test_direct_shadow_starts_at_the_live_version_and_flips_into_it():
    live = {"norm": torch.arange(5, dtype=torch.float32), "embed": torch.ones(3, 2)}
    specs = [TensorSpec(name="norm", shape=(5,), dtype="float32"),
             TensorSpec(name="embed", shape=(3, 2), dtype="float32")]
    ptrs = {n: t.data_ptr() for n, t in live.items()}
    sh = vshadow.DirectShadow(live, specs, torch.device("cpu"))
    assert torch.equal(sh.views["norm"], live["norm"]) and sh.nbytes >= 20 + 24
    assert torch.equal(sh.live_bytes(), sh.arena.buffer)  # the same version
    sh.views["norm"].fill_(7.0)
    sh.views["embed"][1].fill_(-1.0)
    assert live["norm"].sum() == 10  # live untouched until the flip
    sh.flip()
    assert torch.equal(live["norm"], torch.full((5,), 7.0))
    assert live["embed"][1].tolist() == [-1.0, -1.0] and live["embed"][0].tolist() == [1, 1]
    assert {n: t.data_ptr() for n, t in live.items()} == ptrs  # storage stays


def test_standby_saves_restores_and_swaps_in_chunks(monkeypatch):
    monkeypatch.setattr(vshadow, "CHUNK", 3)
    a, b = torch.arange(10, dtype=torch.uint8), torch.arange(100, 107, dtype=torch.uint8)
    st = vshadow.Standby([a, b])
    assert st.nbytes == 17 and not st.held
    st.save(complete=True)
    assert st.held and torch.equal(st.copies[0], torch.arange(10, dtype=torch.uint8))
    a.fill_(1)
    b.fill_(2)
    st.swap()
    assert a.tolist() == list(range(10)) and b.tolist() == list(range(100, 107))
    assert st.copies[0].tolist() == [1] * 10 and st.copies[1].tolist() == [2] * 7
    st.restore()
    assert a.tolist() == [1] * 10
    st.save(complete=False)
    assert not st.held
    st.bind([1000, 2000])
    assert st.by_region[2000] is st.copies[1]
    with pytest.raises(ValueError, match="1 regions for 2 buffers"):
        st.bind([1])


class FakeLink:
    """Records what the replica asked of vLLM (the driver's shadow calls)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.updating = False

    def begin(self) -> None:
        self.calls.append(("begin",))
        self.updating = True

    def flip(self, version) -> float:
        self.calls.append(("flip", version))
        self.updating = False
        return 0.001

    def discard(self) -> None:
        self.calls.append(("discard",))
        self.updating = False

    def rollback(self, version) -> float:
        self.calls.append(("rollback", version))
        return 0.002


def _replica():
    link, fence = FakeLink(), CommandFence("engine0")
    shadow = VllmShadow("engine0", link, fence)
    shadow.memory = [{"arena": 100, "shadow": 10, "standby": 110}] * 2
    return shadow, link, fence


def test_each_command_acts_once_for_all_ranks_of_a_replica():
    shadow, link, fence = _replica()
    for _rank in (0, 1):
        assert shadow.stage(1, epoch=1)
    for _rank in (0, 1):
        assert shadow.flip(1, epoch=2, deadline=None)
    assert fence.version == fence.served == 1
    for _rank in (0, 1):
        assert shadow.stage(2, epoch=3)
    for _rank in (0, 1):
        assert shadow.flip(2, epoch=4, deadline=None)
    for _rank in (0, 1):
        assert shadow.rollback(epoch=5, deadline=None)
    assert link.calls == [("begin",), ("flip", 1), ("begin",), ("flip", 2), ("rollback", 1)]
    assert fence.version == 1 and shadow.last_stall_s == 0.002
    info = shadow.info(1)
    assert (info.owner, info.engine, info.nbytes, info.live) == ("engine0/tp1", "vllm", 120, 1)
    assert info.holds == "undone" and info.version == 2


def test_refusals_change_nothing():
    shadow, link, fence = _replica()
    with pytest.raises(ShadowError, match="flip to version 3 refused"):
        shadow.flip(3, epoch=1, deadline=None)
    with pytest.raises(ShadowError, match="no previous version"):
        shadow.rollback(epoch=2, deadline=None)
    with pytest.raises(ShadowError, match="stage needs a version"):
        shadow.stage(None, epoch=3)
    assert link.calls == [] and fence.version is None
    assert shadow.stage(4, epoch=10)
    assert not shadow.flip(4, epoch=9, deadline=None)  # stale: ignored
    assert not shadow.flip(4, epoch=11, deadline=0.0)  # past its deadline: refused
    assert link.calls == [("begin",)] and link.updating
    assert shadow.discard(epoch=12) and shadow.discard(epoch=12)
    assert link.calls == [("begin",), ("discard",)] and not link.updating
    assert str(shadow.state.holds) == "empty"


def test_a_stage_ends_a_transfer_left_open():
    shadow, link, _ = _replica()
    link.updating = True  # e.g. the replica was held (paused) by the controller
    assert shadow.stage(5, epoch=1)
    assert link.calls == [("discard",), ("begin",)]
