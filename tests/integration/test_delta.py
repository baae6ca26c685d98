"""Sparse delta updates end to end on a local Ray instance: tiny_llama, 4 FSDP2 trainer
actors -> 2 replicas x TP2 over simnic, real AdamW steps. After every update every engine
byte equals the reference layout of the trainers' weights (the demo's byte check,
:func:`actors.tools.demo.verify.check_bytes`); delta updates move fewer bytes than dense anchors;
an engine byte changed behind the chain's back is caught by the digest and re-sent dense;
a failed write makes the next update a dense anchor."""

from __future__ import annotations

import pytest
import ray

from actors.tools.demo.fleet import start_fleet, token_batch
from actors.tools.demo.run_config import load_run_config, parse_run_config
from actors.tools.demo.verify import check_bytes
from actors.tools.testkit.hooks import FaultyInferenceActor, FaultyTrainerActor
from weight_transfer.errors import UpdateError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def fleet(ray_job):
    data = load_run_config("configs/runs/demo.yaml").model_dump(by_alias=True)
    data["train"]["lr"] = 1e-5
    # The time rule off: an uncapped simulated NIC beats any diff, so the rule would
    # write dense; these tests are about the chain (tests/unit/test_delta_policy.py: the rule).
    data["transfer"].update(delta=True, delta_anchor_every=3, update_timeout_s=60,
                            barrier_timeout_s=20, delta_fallback="off")
    run = parse_run_config(data, source="test_delta")
    f = start_fleet(run, actor_classes={"trainer": FaultyTrainerActor,
                                        "engine": FaultyInferenceActor})
    yield f
    f.close()


VERSION = {"last": 0}


def step_and_update(fleet) -> tuple[object, object]:
    cfg = fleet.config.model
    VERSION["last"] += 1
    batch = token_batch(cfg.vocab_size, 4, 32, seed=1000 + VERSION["last"])
    ray.get([t.train_step.remote(batch) for t in fleet.trainers])
    report = fleet.controller.update(VERSION["last"])
    return report, fleet.controller.delta.last


def verified(fleet) -> bool:
    checks, problems = {}, []
    check_bytes(fleet, checks, problems, None)
    assert not problems, problems[:3]
    return checks["bytes"] is True


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
    ray.get(engine.wt_flip_byte.remote("model.layers.0.self_attn.qkv_proj.weight", 64))
    _report, last = step_and_update(fleet)
    assert not last.anchor
    assert last.repaired_bytes > 0
    assert any("digest" in r for r in last.reasons)
    assert verified(fleet)


def test_a_failed_write_makes_the_next_update_a_dense_anchor(fleet):
    ray.get(fleet.trainers[0].wt_fail_after_bytes.remote(100))
    with pytest.raises(UpdateError):
        step_and_update(fleet)
    ray.get(fleet.trainers[0].wt_fail_after_bytes.remote(None))
    _report, last = step_and_update(fleet)
    assert last.anchor
    assert verified(fleet)
    _report, last = step_and_update(fleet)
    assert not last.anchor and last.records_applied > 0
    assert verified(fleet)
