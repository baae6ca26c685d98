"""Epoch-fenced engine commands (no Ray running): a stale or late command changes nothing.

The engine side of :mod:`actors.controller.engine_control`: a rank ignores a pause, resume
or version command older than the newest it has seen, refuses a resume past its
deadline, and a fenced pause makes the version it reports None.
"""

from __future__ import annotations

import time

import pytest

from actors.controller.engine_control import (
    RankFault,
    dead_replicas,
    describe_faults,
    next_epoch,
    responsive,
    wall_deadline,
)
from actors.inference import InferenceMixin
from weight_transfer.types import ShardSpec


class FakeAdapter:
    """Pause state only; no engine."""

    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def wait_idle(self, timeout: float) -> bool:
        return True


@pytest.fixture
def rank() -> InferenceMixin:
    r = InferenceMixin()
    r.wt_attach_engine(adapter=FakeAdapter(), replica="engine0", rank=1,
                       shard=ShardSpec(tp_rank=1, tp_size=2), nics=["n0"])
    r.wt_resume(3)  # serving version 3, unfenced (a user's call)
    return r


def state(r: InferenceMixin) -> tuple[bool, int | None]:
    return r.wt_paused(), r.wt_version()


def test_fenced_pause_marks_the_version_unknown(rank):
    assert rank.wt_pause(epoch=10) is True
    assert state(rank) == (True, None)
    assert rank.wt_resume(4, epoch=11, deadline=time.time() + 60) is True
    assert state(rank) == (False, 4)


def test_stale_commands_are_ignored_whatever_their_order(rank):
    rank.wt_pause(epoch=10)
    resume_then_hold = (("resume", 11), ("pause", 12))
    # The controller gave up on the resume (epoch 11) and held the replica (12); the
    # stopped rank runs them in either order when it continues: it ends held.
    for order in (resume_then_hold, resume_then_hold[::-1]):
        r = InferenceMixin()
        r.wt_attach_engine(adapter=FakeAdapter(), replica="engine0", rank=1,
                           shard=ShardSpec(tp_rank=1, tp_size=2), nics=["n0"])
        r.wt_pause(epoch=10)
        for what, epoch in order:
            if what == "pause":
                r.wt_pause(epoch=epoch)
            else:
                r.wt_resume(5, epoch=epoch, deadline=time.time() + 60)
        assert state(r) == (True, None), order
    assert rank.wt_set_version(7, epoch=9) is False  # older than the pause of 10
    assert state(rank) == (True, None)
    assert [e for e, _, _ in rank.wt_events()][-1] == "stale version"


def test_a_late_resume_is_refused(rank):
    rank.wt_pause(epoch=10)
    assert rank.wt_resume(4, epoch=11, deadline=time.time() - 0.01) is False
    assert state(rank) == (True, None)
    assert [e for e, _, _ in rank.wt_events()][-1] == "late resume"


def test_unfenced_calls_still_work(rank):
    rank.wt_pause(epoch=10)
    assert rank.wt_pause() is True and rank.wt_resume(8) is True  # a user's own calls
    assert state(rank) == (False, 8)


def test_events_are_bounded(rank):
    from actors.inference import EVENTS_KEPT

    for i in range(EVENTS_KEPT + 50):
        rank.wt_set_version(i)
    assert len(rank.wt_events()) == EVENTS_KEPT


def test_epochs_grow_and_deadlines_map_to_wall_time():
    a, b = next_epoch(), next_epoch()
    assert b > a > 0
    assert abs(wall_deadline(time.monotonic() + 5) - (time.time() + 5)) < 0.5


def test_fault_summaries():
    faults = {
        "engine1": [RankFault(replica="engine1", rank=1, kind="dead", method="wt_pause",
                              error="ActorDiedError: gone")],
        "engine2": [RankFault(replica="engine2", rank=0, kind="failed", method="wt_resume",
                              error="ValueError: x")],
        "engine3": [RankFault(replica="engine3", rank=0, kind="unresponsive",
                              method="wt_resume", error="no answer within 5 s")],
    }
    assert dead_replicas(faults) == ["engine1"]
    assert [responsive(faults, n) for n in ("engine0", "engine1", "engine2", "engine3")] == [
        True, False, True, False]
    assert describe_faults(faults)["engine3"] == (
        "engine3/tp0 unresponsive at wt_resume: no answer within 5 s")
