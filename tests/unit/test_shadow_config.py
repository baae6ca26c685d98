"""Shadow mode's configuration and controller checks that need no Ray: the memory a cluster
states, the flip's model, set-up of an engine without a shadow, rollback's bad input,
which replicas a delta update may flip."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.config import TransferConfig
from actors.controller.engine_control import RankFault
from actors.controller.setup import setup_shadow
from actors.controller.state import ControllerState
from actors.controller.strategies import none_flipped, rollback
from actors.controller.update import apply_delta
from scheduling.cluster.config import load_cluster_config
from scheduling.flip import flip_seconds, shadow_need, sync_seconds
from weight_transfer.engines.shadow.store import ShadowError
from weight_transfer.errors import FaultKind
from weight_transfer.model.models import load_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
KIMI = CONFIGS / "models" / "kimi_k2.yaml"


def test_shadow_mode_is_refused_where_the_cluster_has_no_room_naming_the_numbers():
    with pytest.raises(ValueError, match=r"apply='shadow'.*does not fit.*61\.00 GiB of weights"
                                         r".*79\.\d+ GiB \(inference.memory_gib\)") as err:
        TransferConfig.from_files(KIMI, CONFIGS / "clusters" / "perplexity_kimi_k2.yaml",
                                  apply="shadow")
    assert "perplexity_kimi_k2.yaml" in str(err.value)
    cfg = TransferConfig.from_files(KIMI, CONFIGS / "clusters" / "perplexity_kimi_k2_h200.yaml",
                                    apply="shadow")
    assert cfg.apply == "shadow"
    # in place needs no room, and a cluster that states no memory is not checked
    TransferConfig.from_files(KIMI, CONFIGS / "clusters" / "perplexity_kimi_k2.yaml")
    TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                              CONFIGS / "clusters" / "local_cpu.yaml", apply="shadow")


def test_the_flip_model_is_a_swap_at_the_device_copy_rate():
    model = load_model_config(KIMI)
    h200 = load_cluster_config(CONFIGS / "clusters" / "perplexity_kimi_k2_h200.yaml")
    need = shadow_need(model, h200, fp8=True)
    assert need.fits and need.rank_bytes == need.extra_bytes - (8 << 20)
    assert flip_seconds(need.rank_bytes, 2400) == pytest.approx(2 * need.rank_bytes / 2.4e12)
    assert flip_seconds(need.rank_bytes, None) is None
    # a delta update's copy of live into the shadow: half a swap's traffic, while serving
    assert sync_seconds(need.rank_bytes, 2400) == pytest.approx(need.rank_bytes / 2.4e12)
    assert sync_seconds(need.rank_bytes, None) is None


def test_an_engine_without_a_shadow_is_refused_at_setup_naming_it():
    class VllmRankFacade:  # an actor handle's stand-in: no shadow methods
        def wt_engine_meta(self):
            pass

    with pytest.raises(ShadowError, match="engine VllmRankFacade cannot run shadow mode"):
        setup_shadow(None, [VllmRankFacade()], None)  # refused before any call


def state(versions, previous):
    st = ControllerState(trainers=[], connector=None)
    st.summary = SimpleNamespace()
    st.replicas = {n: [] for n in versions}
    st.versions, st.previous = dict(versions), dict(previous)
    return st


@pytest.mark.parametrize("apply,in_flight,previous,match", [
    ("in_place", None, {"engine0": 1}, "needs TransferConfig.apply='shadow'"),
    ("shadow", 3, {"engine0": 1}, "update to version 3 is in flight"),
    ("shadow", None, {"engine0": None}, r"no previous version on replicas \['engine0'\]"),
])
def test_rollback_refuses_bad_input_and_changes_nothing(apply, in_flight, previous, match):
    st = state({"engine0": 2}, previous)
    cfg = SimpleNamespace(apply=apply, update_timeout_s=10.0)
    with pytest.raises(ValueError, match=match):
        rollback(st, None, cfg, None, in_flight)  # no call made: calls and audit unused
    assert st.versions == {"engine0": 2} and st.previous == previous


def test_a_replica_is_torn_by_a_flip_only_if_some_rank_may_have_swapped():
    def fault(rank, kind):
        return RankFault(replica="e", rank=rank, kind=kind, method="wt_flip", error="x")

    assert none_flipped([fault(0, FaultKind.REFUSED), fault(1, FaultKind.FAILED)], 2)
    assert not none_flipped([fault(0, FaultKind.REFUSED)], 2)  # rank 1 flipped
    assert not none_flipped([fault(0, FaultKind.REFUSED), fault(1, FaultKind.UNRESPONSIVE)], 2)


class Chain:
    """A delta chain whose apply and repair succeed or raise."""

    def __init__(self, anchor: bool, error: Exception | None = None) -> None:
        self.anchor, self.error, self.applied = anchor, error, []

    def after(self, version, names):
        if self.error is not None:
            raise self.error
        self.applied.append((version, names))


@pytest.mark.parametrize("anchor, errors, error, flips", [
    (False, False, None, True),  # applied and repaired: the check and flip go on
    (False, False, RuntimeError("repair: trainer rank 1 died"), False),
    (False, True, None, False),  # a trainer failed: its records cannot be repaired
    (True, True, None, True),  # an anchor: complete replicas hold whole pieces
])
def test_a_delta_update_flips_only_replicas_whose_shadow_got_every_record(anchor, errors, error,
                                                                          flips):
    chain, faults = Chain(anchor, error), {}
    failed = apply_delta(chain, 5, ["engine0", "engine1"], {"engine1"}, errors, faults)
    assert failed == (set() if flips else {"engine0"})
    assert chain.applied == ([(5, ["engine0"])] if flips and not errors else [])
    if not flips:
        assert [(f.replica, f.method) for f in faults["engine0"]] == [("engine0", "delta apply")]
        assert "engine1" not in faults  # failed already (its fence): not applied to


def test_the_stall_is_the_longest_gap_between_steps_that_overlaps_the_update():
    from actors.tools.bench.stall.bench import idle_gap, stall_of

    steps = [0.0, 0.1, 0.2, 1.5, 1.6, 1.7]
    assert stall_of(steps, 0.25, 1.4) == pytest.approx(1.3)  # 0.2 -> 1.5 spans it
    assert stall_of(steps, 1.55, 1.58) == pytest.approx(0.1)
    assert stall_of([0.5], 0.0, 1.0) == 0.0
    assert idle_gap(steps, [(0.25, 1.4)]) == pytest.approx(0.1)


def test_a_wait_counts_only_the_part_inside_the_update():
    from actors.tools.bench.stall.bench import wait_within

    steps = [0.0, 0.1, 0.2, 1.5, 1.6, 1.7]
    assert wait_within(steps, 1.4, 1.8) == pytest.approx(0.1)  # 0.2 -> 1.5: only 0.1 inside
    assert wait_within(steps, 0.25, 1.4) == pytest.approx(1.15)  # no step inside: all of it
    assert wait_within(steps, 0.15, 1.55) == pytest.approx(1.3)  # 0.2 -> 1.5 inside
    assert wait_within([], 2.0, 3.0) == pytest.approx(1.0)  # never stepped: the whole update


def test_the_idle_floor_is_the_median_of_the_longest_gaps_of_update_long_windows():
    from actors.tools.bench.stall.bench import idle_floor

    # steps every 10 ms, one 50 ms hiccup at 0.3: windows of 0.1 s over [0, 1]
    steps = [i / 100 for i in range(31)] + [0.35 + i / 100 for i in range(66)]
    assert idle_floor(steps, 0.0, 1.0, 0.1) == pytest.approx(0.01)  # the hiccup is one window
    assert idle_floor(steps, 0.25, 0.45, 0.1) == pytest.approx(0.05)
    assert idle_floor(steps, 0.0, 1.0, 2.0) == pytest.approx(0.05)  # longer: one window
    assert idle_floor(steps, 0.0, 1.0, 0.0) == 0.0


def test_an_adapter_without_a_second_copy_is_refused_by_the_rank_naming_the_engine():
    from actors.inference import InferenceMixin
    from weight_transfer.types import NicId, ShardSpec

    class PlainAdapter:  # an engine that exposes its buffers, with no shadow
        engine_name = "my-engine"
        paused = False

    rank = InferenceMixin()
    rank.wt_attach_engine(adapter=PlainAdapter(), replica="engine0", rank=1,
                          shard=ShardSpec(tp_rank=1, tp_size=2),
                          nics=[NicId(node="inode0", index=0)])
    with pytest.raises(ShadowError, match="engine0/tp1: the my-engine engine cannot hold a "
                                          "shadow copy"):
        rank.wt_shadow_setup()
    with pytest.raises(ShadowError, match="shadow mode is not set up"):
        rank.wt_stage(3, epoch=1)


def test_shadow_mode_does_not_combine_with_replica_groups():
    with pytest.raises(ValueError, match="apply='shadow' does not combine with replica_groups"):
        TransferConfig(apply="shadow", replica_groups=[["engine0", "engine1"]])


def test_shadow_mode_combines_with_deltas():
    cfg = TransferConfig(apply="shadow", delta=True)
    assert cfg.delta and cfg.apply == "shadow"
