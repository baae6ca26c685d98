"""Replica groups on one host (simnic): the trainers write the leader, a peer copy fills the rest.

One fleet (2 trainer ranks -> 2 replicas x TP2: the ``reference-fleet`` group's actors,
``tests/integration/conftest.py``), its controller with ``replica_groups`` =
``[["engine0", "engine1"]]``: the plan writes engine0 only (half the bytes of a
plan over both), engine1 is filled from engine0 by the peer copy after every
update, and every byte of both equals the reference layout of the trainers'
weights. When the leader misses bytes (a trainer rank's link down), the follower
is torn too, and the error names why; the next update fills both again. The check
of served memory knows the follower's bytes too (its leader's checksums at its own
addresses): a flipped byte in the follower is found and healed. The same
across network namespaces behind a shaped link: tests/integration/test_netns.py.
"""

from __future__ import annotations

import pytest
import ray
import torch

from actors import WeightTransferController
from actors.tools.testkit.engine_bytes import engine_mismatches
from weight_transfer.errors import UpdateError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TOKENS = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def fleet(reference_fleet):  # the reference-fleet group's actors (tests/integration/conftest.py)
    cfg = reference_fleet.config(replica_groups=[["engine0", "engine1"]],
                                 integrity={"mode": "full"}, update_timeout_s=60,
                                 retry={"attempts": 1})
    trainers, replicas = reference_fleet.trainers, reference_fleet.replicas
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    yield cfg, ctl, trainers, list(replicas)
    ctl.shutdown()


def _step(trainers) -> None:
    ray.get([t.train_step.remote(TOKENS) for t in trainers])


def test_the_trainers_write_the_leader_and_a_peer_fills_the_follower(fleet):
    cfg, ctl, trainers, replicas = fleet
    assert sorted({r for rs in ctl.summary.replicas_by_rank.values() for r in rs}) == ["engine0"]
    per_replica = ctl.summary.bytes_total
    for version in (1, 2):
        _step(trainers)
        report = ctl.update(version)
        assert report.bytes == per_replica  # one replica from the trainers
        assert ctl.group_copies == {"engine1": per_replica}  # the other from its peer
        assert ctl.weights_version() == {"engine0": version, "engine1": version}
        assert engine_mismatches(cfg.model, trainers, replicas) == []


def test_a_torn_leader_tears_its_followers_and_the_next_update_heals_both(fleet):
    cfg, ctl, trainers, replicas = fleet
    _step(trainers)
    ray.get(trainers[1].wt_set_link.remote(False))  # rank 1's writes into engine0 fail
    try:
        with pytest.raises(UpdateError) as err:
            ctl.update(3)
    finally:
        ray.get(trainers[1].wt_set_link.remote(True))
    assert set(err.value.torn) == {"engine0", "engine1"}
    assert "its group's leader engine0 is torn" in str(err.value)
    assert ctl.weights_version() == {"engine0": None, "engine1": None}
    _step(trainers)
    ctl.update(4)
    assert ctl.weights_version() == {"engine0": 4, "engine1": 4}
    assert engine_mismatches(cfg.model, trainers, replicas) == []


def test_the_served_check_covers_the_follower_s_bytes(fleet):
    cfg, ctl, trainers, replicas = fleet
    _step(trainers)
    ctl.update(5)
    assert ctl.check_integrity().check.ok
    name = "model.layers.1.mlp.down_proj.weight"
    ray.get(replicas[1][1].wt_flip_byte.remote(name, 7))  # engine1/tp1: the follower
    found = ctl.check_integrity(heal=True)
    assert not found.check.ok and list(found.check.torn) == ["engine1"]
    assert found.healed == ("engine1",)
    assert ctl.check_integrity().check.ok
    assert engine_mismatches(cfg.model, trainers, replicas) == []
