"""Shadow mode on the reference engine: the engines serve throughout, flip, and roll back.

2 FSDP2 trainer ranks -> 2 replicas x TP2 (tiny_llama), ``apply="shadow"``, integrity
``full``, an audit log, on the ``reference-fleet`` group's actors
(``tests/integration/conftest.py``): the group's last module (its engines hold a shadow
from the set-up on; so may they already, from the delta module's shadow controller).
Each test works from the version the fleet holds when it starts (the ``base`` fixture
first brings every replica to one version, where they differ or hold none), so the tests
pass alone and in any order:

1. an update: while the writes land and are checked, every engine still serves (a
   generation runs from the ``after_transfer`` hook) and its live bytes are the old
   version's exactly; after the flip they are the trainers' new weights; the set-up
   report states the shadow bytes of every rank;
2. a transfer that fails its check on one replica (a byte of its shadow inverted after
   the writes): that replica is not flipped, its live bytes are untouched and it keeps
   reporting the version it had; the other flips; the next update heals both;
3. ``rollback()`` after the new version served: every replica's bytes equal the previous
   version's exactly, versions go back, one audit line; a second rollback, a rollback
   with an update in flight: ValueError naming why, nothing changed;
4. an in-place controller over these engines (which keep their shadow): refused at setup,
   naming the rank (its writes would land in the shadow, never served), nothing changed.
"""

from __future__ import annotations

import json

import pytest
import ray
import torch

from actors import WeightTransferController
from actors.controller.audit import read_audit
from actors.tools.testkit.engine_bytes import engine_mismatches
from weight_transfer.errors import UpdateError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
FLEET_SHADOW_ONLY = True  # reference_fleet: engines holding a shadow already will do
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.fixture(scope="module")
def env(tmp_path_factory, reference_fleet):  # the group's last module: see the docstring
    tmp = tmp_path_factory.mktemp("shadow")
    cfg = reference_fleet.config(apply="shadow", integrity={"mode": "full"},
                                 audit_path=tmp / "audit.jsonl")
    trainers, replicas = reference_fleet.trainers, reference_fleet.replicas
    reference_fleet.hold_shadow()  # its engines hold a shadow from the setup on
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    yield cfg, trainers, replicas, ctl
    ctl.shutdown()


def train(trainers, step):
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(step))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])


def live(replica):
    return [ray.get(a.engine_state_bytes.remote()) for a in replica]


def same(a, b):
    return all(set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
               for x, y in zip(a, b, strict=True))


def generate(replica):
    return ray.get([a.generate.remote(PROMPTS, 3) for a in replica], timeout=60)[0]


def next_version(ctl) -> int:
    """One past the newest version any replica holds (1 on a fresh fleet)."""
    return max((v for v in ctl.weights_version().values() if v is not None), default=0) + 1


@pytest.fixture
def base(env) -> int:
    """The version every replica holds as the test starts: where one holds none or they
    differ (a fresh module, or an earlier test that stopped half-way), an update first."""
    _, trainers, _, ctl = env
    held = set(ctl.weights_version().values())
    if None in held or len(held) != 1:
        version = next_version(ctl)
        train(trainers, version)
        ctl.update(version)
        held = set(ctl.weights_version().values())
    (version,) = held
    return version


def test_engines_serve_the_old_bytes_until_the_flip(env):
    cfg, trainers, replicas, ctl = env
    v = next_version(ctl)
    train(trainers, v)  # new bytes to write, whichever test ran before
    assert set(ctl.summary.shadow_bytes) == {f"engine{i}/tp{r}" for i in (0, 1) for r in (0, 1)}
    assert all(n > 0 for n in ctl.summary.shadow_bytes.values())
    before = [live(rep) for rep in replicas]
    seen = {}

    def during(version):  # writes landed and checked: the flip has not happened
        seen["tokens"] = [generate(rep) for rep in replicas]  # serving, not paused
        seen["untouched"] = all(same(live(rep), b) for rep, b in zip(replicas, before,
                                                                     strict=True))

    ctl.after_transfer = during
    try:
        ctl.update(v)
    finally:
        ctl.after_transfer = None
    assert seen["untouched"] and len(seen["tokens"]) == 2
    assert engine_mismatches(cfg.model, trainers, replicas) == []
    assert ctl.weights_version() == {"engine0": v, "engine1": v}
    assert ray.get(replicas[0][0].wt_events.remote())[-1][:2] == ("flip", v)


def test_a_failed_check_leaves_live_memory_untouched_and_the_next_update_heals(env, base):
    cfg, trainers, replicas, ctl = env
    train(trainers, base + 1)
    before = live(replicas[1])
    tensor = "model.layers.0.mlp.down_proj.weight"

    def corrupt(version):  # a byte of engine1's shadow lands wrong
        ray.get(replicas[1][1].wt_flip_byte.remote(tensor, 5))

    ctl.after_transfer = corrupt
    try:
        with pytest.raises(UpdateError, match="engine1") as err:
            ctl.update(base + 1)
    finally:
        ctl.after_transfer = None
    assert err.value.torn == [] and err.value.kept == {"engine1": base}
    assert ctl.weights_version() == {"engine0": base + 1, "engine1": base}
    assert same(live(replicas[1]), before)  # the failed transfer never touched live memory
    assert [ray.get(a.wt_version.remote()) for a in replicas[1]] == [base, base]
    assert not any(ray.get(a.wt_paused.remote()) for a in replicas[1])
    assert len(generate(replicas[1])) == 2  # still serving version base
    ctl.update(base + 2)  # the next update heals
    assert ctl.weights_version() == {"engine0": base + 2, "engine1": base + 2}
    assert engine_mismatches(cfg.model, trainers, replicas) == []


def rollbacks(cfg) -> list[dict]:
    return [r for r in read_audit(cfg.audit_path) if r["kind"] == "rollback"]


def test_rollback_restores_the_previous_bytes_exactly(env, base, tmp_path):
    cfg, trainers, replicas, ctl = env
    audited = len(rollbacks(cfg))
    train(trainers, base + 1)
    ctl.after_transfer = lambda v: ctl.rollback()
    try:
        with pytest.raises(ValueError, match=f"update to version {base + 1} is in flight"):
            ctl.update(base + 1)  # a rollback asked while the transfer is in flight: refused
    finally:
        ctl.after_transfer = None
    assert ctl.weights_version() == {"engine0": base, "engine1": base}
    good, bad = base + 2, base + 3
    ctl.update(good)
    at_good = [live(rep) for rep in replicas]
    tokens_good = [generate(rep) for rep in replicas]
    train(trainers, bad)
    ctl.update(bad)
    assert not any(same(live(rep), b) for rep, b in zip(replicas, at_good, strict=True))
    generate(replicas[0])  # the new version served before it is declared bad
    assert ctl.rollback() == {"engine0": good, "engine1": good}
    assert all(same(live(rep), b) for rep, b in zip(replicas, at_good, strict=True))  # exactly
    assert [generate(rep) for rep in replicas] == tokens_good
    assert [ray.get(a.wt_version.remote()) for rep in replicas for a in rep] == [good] * 4
    with pytest.raises(ValueError, match="no previous version on replicas"):
        ctl.rollback()  # rolled back already: nothing changed
    assert ctl.weights_version() == {"engine0": good, "engine1": good}
    assert all(same(live(rep), b) for rep, b in zip(replicas, at_good, strict=True))
    lines = rollbacks(cfg)[audited:]
    assert len(lines) == 1 and lines[0]["outcome"] == "ok"
    assert lines[0]["before"] == {"engine0": bad, "engine1": bad}
    assert lines[0]["after"] == {"engine0": good, "engine1": good}
    trace = tmp_path / f"update{bad + 1}.json"
    report = ctl.update(bad + 1, trace=trace)  # and updates go on from there, traced as in place
    assert engine_mismatches(cfg.model, trainers, replicas) == []
    assert report.trace is not None and json.loads(trace.read_text())["traceEvents"]


def test_an_in_place_controller_over_engines_holding_a_shadow_is_refused(env, base):
    """The engines keep the shadow this module's set-up gave them: an in-place update would
    write that copy, never flipped, and report success while the engines serve the old
    weights. Its setup is refused naming the rank and the remedy; nothing changes."""
    cfg, trainers, replicas, ctl = env
    served = [live(rep) for rep in replicas]
    versions = ctl.weights_version()
    other = WeightTransferController(trainers=trainers, engines=replicas,
                                     config=cfg.replace(apply="in_place"))
    try:
        with pytest.raises(ValueError, match=r"engine0/tp0\).*shadow copy.*apply='shadow'"):
            other.setup()
    finally:
        other.shutdown()
    assert all(same(live(rep), b) for rep, b in zip(replicas, served, strict=True))
    assert ctl.weights_version() == versions
    v = next_version(ctl)
    train(trainers, v)
    ctl.update(v)  # the shadow-mode controller goes on
    assert engine_mismatches(cfg.model, trainers, replicas) == []
