"""Typed identities: an engine rank and a NIC are value objects; ``str()`` is the name on
the wire (logs, JSON, region owners, peer keys, plans), unchanged from the strings of old."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from scheduling.cluster.config import load_cluster_config
from weight_transfer.types import EngineRankId, NicId

CLUSTERS = Path(__file__).resolve().parents[2] / "configs" / "clusters"


def test_engine_rank_id_prints_the_wire_name_and_is_a_value():
    a = EngineRankId(replica="engine0", rank=1)
    assert str(a) == "engine0/tp1" and f"{a}" == "engine0/tp1"
    assert a == EngineRankId(replica="engine0", rank=1) and len({a, EngineRankId(
        replica="engine0", rank=1)}) == 1
    assert sorted([EngineRankId(replica="engine1", rank=0), a]) == [
        a, EngineRankId(replica="engine1", rank=0)]
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(TypeError):
        EngineRankId("engine0", 1)  # keyword arguments only


@pytest.mark.parametrize(("nic", "name"), [(NicId(node="inode0", index=0), "inode0/nic0"),
                                           (NicId(node="tnode12", index=3), "tnode12/nic3")])
def test_nic_id_round_trips_through_its_name(nic, name):
    assert str(nic) == name and NicId.parse(name) == nic


@pytest.mark.parametrize("bad", ["inode0", "inode0/nicX", "/nic0", "inode0/tp0", ""])
def test_a_nic_name_of_another_form_is_a_value_error(bad):
    with pytest.raises(ValueError, match="is not '<node>/nic<index>'"):
        NicId.parse(bad)


@pytest.mark.parametrize("cluster", sorted(p.name for p in CLUSTERS.glob("*.yaml")))
def test_the_cluster_config_hands_out_the_nics_its_plans_use(cluster):
    cfg = load_cluster_config(CLUSTERS / cluster)
    inf = cfg.inference
    for replica in range(min(inf.replicas, 4)):
        for local in range(min(inf.gpus_per_replica, 16)):
            nic = cfg.engine_nic(replica, local)
            node, name, _ = cfg.engine_rank(replica, local)
            assert (nic.node, str(nic)) == (node, name) and str(nic) in cfg.engine_nics()
    for rank in range(min(cfg.trainer_world, 64)):
        info = cfg.rank_info(rank)
        assert info.nic == cfg.trainer_nics()[cfg.trainer_nic_index(rank)]
        assert NicId.parse(info.nic).node == info.node
