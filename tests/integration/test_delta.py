"""Sparse delta updates end to end on the shared Ray cluster: tiny_llama, 2 FSDP2 trainer
actors -> 2 replicas x TP2 over simnic, real AdamW steps (at a learning rate of 1e-5, set on
the trainers for this module). The ``reference-fleet`` group's actors
(``tests/integration/conftest.py``) serve the module, first under an in-place controller,
then under a second controller in shadow mode (``apply="shadow"``, integrity ``full``) over
the same actors: the engines register their memory again, as the shadow, and their delta
arenas with it (and keep the shadow: only the shadow module follows in the group).

In place (after every update every engine byte equals the reference layout of the
trainers' weights, the demo's byte check :func:`actors.tools.demo.verify.check_bytes`):

1. delta updates move fewer bytes than dense anchors;
2. an engine byte changed behind the chain's back is caught by the digest and re-sent dense;
3. a failed write makes the next update a dense anchor.

In shadow mode:

4. anchor, three deltas, anchor: after every flip every engine byte equals the reference
   layout; a delta stage copied live into the shadow (its time reported), deltas move a
   fraction of the bytes, and after each flip the shadow keeps the version before;
5. a live byte changed behind the chain (the copy into the shadow carries it: the
   record's base digest differs) and a slot header that never landed (after the
   writes): both healed by dense re-sends into the shadow before the flip;
6. a delta transfer that fails: live memory and the versions served are untouched, the
   next update is a dense anchor and the one after a delta again;
7. rollback after a delta flip: every live byte equals the previous version's exactly;
   the next update is an anchor and heals forward.

A failed transfer fails every trainer rank's writes: a rank that did not fail would wait
at the mesh group's barrier for the failed one until ``barrier_timeout_s`` (the behaviour
under test is the chain's and the shadow's, not that wait).
"""

from __future__ import annotations

import pytest
import ray
import torch

from actors import WeightTransferController
from actors.tools.demo.fleet import token_batch, transfer_config
from actors.tools.demo.fleet_handle import Fleet
from actors.tools.demo.run_config import load_run_config, parse_run_config
from actors.tools.demo.verify import _flip_byte as flip_live_byte
from actors.tools.demo.verify import check_bytes
from weight_transfer.errors import UpdateError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
QKV = "model.layers.0.self_attn.qkv_proj.weight"


LR = 1e-5  # bf16 AdamW steps that leave most elements as they were: sparse deltas


@pytest.fixture(scope="module")
def fleet(reference_fleet):
    def set_lr(trainer, lr: float) -> float:  # in the trainer actor; nested: shipped by value
        """Every parameter group's learning rate to ``lr``; the one it had."""
        before = trainer.optimizer.param_groups[0]["lr"]
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        return before

    # 2 trainer ranks (one node, a NIC each) -> the demo's 2 replicas x TP2.
    data = load_run_config("configs/runs/demo.yaml").model_dump(by_alias=True)
    data["cluster"] = str(reference_fleet.cluster_file)
    data["train"]["lr"] = LR
    # The time rule off: an uncapped simulated NIC beats any diff, so the rule would
    # write dense; these tests are about the chain (tests/unit/test_delta_policy.py: the rule).
    data["transfer"].update(delta=True, delta_anchor_every=3, update_timeout_s=60,
                            barrier_timeout_s=20, delta_fallback="off")
    run = parse_run_config(data, source="test_delta")
    cfg = transfer_config(run)
    trainers, replicas = list(reference_fleet.trainers), list(reference_fleet.replicas)
    lrs = ray.get([t.__ray_call__.remote(set_lr, LR) for t in trainers])
    try:
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        names = [cfg.cluster.replica_name(i) for i in range(len(replicas))]
        f = Fleet(run=run, config=cfg, trainers=trainers, controller=ctl, setup_seconds=0.0,
                  replicas=dict(zip(names, replicas, strict=True)))
        ctl.setup()
        yield f
        f.controller.shutdown()
    finally:
        ray.get([t.__ray_call__.remote(set_lr, lr) for t, lr in zip(trainers, lrs, strict=True)])


@pytest.fixture(scope="module")
def shadow(fleet, reference_fleet):
    """The same actors under a second controller, in shadow mode (the in-place one shut
    down): the fleet's controller and config from then on."""
    fleet.controller.shutdown()
    reference_fleet.hold_shadow()
    cfg = fleet.config.replace(apply="shadow", integrity={"mode": "full"})
    ctl = WeightTransferController(trainers=fleet.trainers, config=cfg,
                                   engines=list(fleet.replicas.values()))
    fleet.controller, fleet.config = ctl, cfg
    ctl.setup()
    return fleet


VERSION = {"last": 0}


def train(fleet) -> int:
    VERSION["last"] += 1
    cfg = fleet.config.model
    batch = token_batch(cfg.vocab_size, 4, 32, seed=1000 + VERSION["last"])
    ray.get([t.train_step.remote(batch) for t in fleet.trainers])
    return VERSION["last"]


def step_and_update(fleet) -> tuple[object, object]:
    report = fleet.controller.update(train(fleet))
    return report, fleet.controller.delta.last


def to_delta(fleet) -> None:
    """Update until the next update is a delta (not an anchor)."""
    chain = fleet.controller.delta
    while chain.force or chain.since_anchor >= chain.every:
        step_and_update(fleet)


def verified(fleet) -> bool:
    checks, problems = {}, []
    check_bytes(fleet, checks, problems, None)
    assert not problems, problems[:3]
    return checks["bytes"] is True


def fail_writes(fleet, nbytes: int | None) -> None:
    """Every trainer rank delivers ``nbytes`` more bytes, then fails (None: off)."""
    ray.get([t.wt_fail_after_bytes.remote(nbytes) for t in fleet.trainers])


def live(fleet) -> list[list[dict[str, torch.Tensor]]]:
    return [[ray.get(a.engine_state_bytes.remote()) for a in rep]
            for rep in fleet.replicas.values()]


def same(a, b) -> bool:
    return all(set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
               for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def shadow_infos(fleet) -> list:
    return [ray.get(a.wt_shadow_info.remote()) for rep in fleet.replicas.values() for a in rep]


# ------------------------------------------------------------------------------- in place


def test_delta_updates_equal_dense_ones_and_move_fewer_bytes(fleet):
    rounds = [step_and_update(fleet) for _ in range(5)]
    assert [last.anchor for _, last in rounds] == [True, False, False, False, True]
    assert verified(fleet)
    dense = rounds[0][0].bytes
    for report, last in rounds[1:4]:
        assert report.bytes < dense / 3  # records, not pieces
        assert last.records_applied > 0 and last.repaired_bytes == 0
    for report, last in (rounds[0], rounds[4]):
        assert report.bytes == dense and last.records_applied == 0


def test_engine_bytes_changed_behind_the_chain_are_resent_dense(fleet):
    step_and_update(fleet)  # a delta: the chain holds
    engine = fleet.replicas["engine0"][0]
    ray.get(engine.wt_flip_byte.remote(QKV, 64))
    _report, last = step_and_update(fleet)
    assert not last.anchor
    assert last.repaired_bytes > 0
    assert any("digest" in r for r in last.reasons)
    assert verified(fleet)


def test_a_failed_write_makes_the_next_update_a_dense_anchor(fleet):
    fail_writes(fleet, 100)
    try:
        with pytest.raises(UpdateError):
            step_and_update(fleet)
    finally:
        fail_writes(fleet, None)
    _report, last = step_and_update(fleet)
    assert last.anchor
    assert verified(fleet)
    _report, last = step_and_update(fleet)
    assert not last.anchor and last.records_applied > 0
    assert verified(fleet)


# ---------------------------------------------------------- shadow mode, the same actors


def test_delta_updates_in_shadow_mode_equal_dense_ones(shadow):
    fleet, rounds, previous = shadow, [], None
    for _ in range(5):
        before = live(fleet)
        rounds.append(step_and_update(fleet))
        assert verified(fleet)
        infos = shadow_infos(fleet)
        assert {i.holds for i in infos} == {"previous"} or previous is None
        if previous is not None:  # the shadow keeps the version served before the flip
            assert {i.version for i in infos} == {VERSION["last"] - 1}
        if not rounds[-1][1].anchor:
            assert all(i.last_sync_s > 0 for i in infos)
        previous = before
    assert [last.anchor for _, last in rounds] == [True, False, False, False, True]
    dense = rounds[0][0].bytes
    for report, last in rounds[1:4]:
        assert report.bytes < dense / 3  # records, not pieces
        assert last.records_applied > 0 and last.repaired_bytes == 0
    for report, last in (rounds[0], rounds[4]):
        assert report.bytes == dense and last.records_applied == 0
    assert fleet.controller.weights_version() == {n: VERSION["last"] for n in fleet.replicas}


def test_a_stale_base_and_a_dropped_slot_are_healed_dense_into_the_shadow(shadow):
    fleet = shadow
    to_delta(fleet)
    engine = fleet.replicas["engine0"][0]
    ray.get(engine.__ray_call__.remote(flip_live_byte, QKV, 64))  # live, not the shadow
    _report, last = step_and_update(fleet)
    assert not last.anchor and last.repaired_bytes > 0
    assert any("digest" in r for r in last.reasons)
    assert verified(fleet)

    to_delta(fleet)
    ctl = fleet.controller
    ctl.after_transfer = lambda version: ray.get(  # trainer rank 0's header never landed
        fleet.replicas["engine1"][1].wt_drop_delta_header.remote(0))
    try:
        _report, last = step_and_update(fleet)
    finally:
        ctl.after_transfer = None
    assert not last.anchor and last.repaired_bytes > 0
    assert any(a.bad_slots for a in last.applied)
    assert verified(fleet)


def test_a_failed_delta_transfer_leaves_live_memory_and_versions_untouched(shadow):
    fleet = shadow
    to_delta(fleet)
    ctl = fleet.controller
    before, versions = live(fleet), ctl.weights_version()
    fail_writes(fleet, 100)
    try:
        with pytest.raises(UpdateError):
            step_and_update(fleet)
    finally:
        fail_writes(fleet, None)
    assert same(live(fleet), before)
    assert ctl.weights_version() == versions
    assert {ray.get(a.wt_version.remote()) for rep in fleet.replicas.values()
            for a in rep} == set(versions.values())
    assert {i.holds for i in shadow_infos(fleet)} == {"empty"}  # discarded
    _report, last = step_and_update(fleet)
    assert last.anchor
    assert verified(fleet)
    _report, last = step_and_update(fleet)
    assert not last.anchor and last.records_applied > 0
    assert verified(fleet)


def test_rollback_after_a_delta_flip_returns_the_previous_bytes_exactly(shadow):
    fleet = shadow
    to_delta(fleet)
    step_and_update(fleet)
    to_delta(fleet)
    ctl = fleet.controller
    before, versions = live(fleet), ctl.weights_version()
    _report, last = step_and_update(fleet)
    assert not last.anchor and last.records_applied > 0
    assert not same(live(fleet), before)
    assert ctl.rollback() == versions
    assert same(live(fleet), before)
    _report, last = step_and_update(fleet)  # live is older than the trainers' base
    assert last.anchor
    assert verified(fleet)
