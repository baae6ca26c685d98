"""Replica groups (pure): leaders, followers, what the trainers write, and bad input named.

Also the pure parts of the namespace harness (the shaping's numbers, the subnet
choice that avoids every route of this host).
"""

from __future__ import annotations

import ipaddress

import pytest

from actors import TransferConfig
from actors.replica_groups import ReplicaGroups
from actors.tools.testkit.netns import NetnsNetwork, Shaping, host_networks, pick_subnet

GROUPS = [["engine0", "engine1"], ["engine2", "engine3", "engine4"]]


@pytest.mark.parametrize("present, followers, planned", [
    (["engine0", "engine1", "engine2", "engine3", "engine4"],
     {"engine1": "engine0", "engine3": "engine2", "engine4": "engine2"},
     ["engine0", "engine2"]),
    # The leader is the first member present: engine2 gone, engine3 leads its group.
    (["engine0", "engine1", "engine3", "engine4"],
     {"engine1": "engine0", "engine4": "engine3"}, ["engine0", "engine3"]),
    # A group of one present replica has no follower; replicas in no group are planned.
    (["engine1", "engine4", "engine9"], {}, ["engine1", "engine4", "engine9"]),
    ([], {}, []),
])
def test_followers_and_planned_replicas(present, followers, planned):
    groups = ReplicaGroups.parse(GROUPS)
    assert groups.followers(present) == followers
    assert groups.planned(present) == planned
    assert groups.site_of("engine3") == 1 and groups.site_of("engine9") is None


def test_no_groups_or_groups_of_one_change_nothing():
    for value in (None, [], [["engine0"], ["engine1"]]):
        groups = ReplicaGroups.parse(value)
        assert not groups
        assert groups.planned(["engine0", "engine1"]) == ["engine0", "engine1"]


@pytest.mark.parametrize("value, message", [
    ("engine0", r"replica_groups: a list of groups"),
    ([["engine0"], "engine1"], r"replica_groups\[1\]: a list of replica names"),
    ([["engine0"], []], r"replica_groups\[1\]: an empty group"),
    ([["engine0", 3]], r"replica_groups\[0\]: replica names are strings, not 3"),
    ([["engine0", "engine1"], ["engine1"]],
     r"replica 'engine1' is in groups 0 and 1; a replica belongs to one group"),
])
def test_bad_groups_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        ReplicaGroups.parse(value)


def test_the_config_field_is_checked_and_typed():
    cfg = TransferConfig(replica_groups=GROUPS)
    assert cfg.replica_groups == (("engine0", "engine1"), ("engine2", "engine3", "engine4"))
    assert TransferConfig().replica_groups == ()
    with pytest.raises(ValueError, match=r"TransferConfig.replica_groups: replica 'engine1'"):
        TransferConfig(replica_groups=[["engine1"], ["engine1"]])


def test_shaping_numbers_and_bad_values():
    s = Shaping(rate_mbit=40, burst_bytes=32768, latency_ms=100)
    assert s.bytes_per_s == 5e6
    assert s.tbf_args() == ["tbf", "rate", "40mbit", "burst", "32768", "latency", "100ms"]
    with pytest.raises(ValueError, match="must be positive"):
        Shaping(rate_mbit=0)


def test_the_subnet_overlaps_no_route_of_this_host():
    used = host_networks()
    for seed in (0, 7, 255):
        net = pick_subnet(seed)
        assert net.prefixlen == 24 and net.subnet_of(ipaddress.ip_network("10.213.0.0/16"))
        assert not any(net.overlaps(u) for u in used)


def test_site_labels_are_checked_before_anything_is_made():
    with pytest.raises(ValueError, match="distinct and non-empty"):
        NetnsNetwork(["a", "a"])
    net = NetnsNetwork(["trainers", "engines"], prefix="wtX")
    assert [s.ns for s in net.sites.values()] == ["wtXa", "wtXb"]
    with pytest.raises(ValueError, match=r"no site 'nope'; sites: \['engines', 'trainers'\]"):
        net.site("nope")


def test_wt_bench_groups_without_namespaces_says_why(monkeypatch, capsys):
    import actors.tools.bench.groups.bench as groups

    monkeypatch.setattr(groups, "netns_unavailable", lambda: "network namespaces need root")
    assert groups.run(rate_mbit=40, updates=1, transport="tcp", json_path=None) == 2
    assert "wt bench groups: network namespaces need root" in capsys.readouterr().out


def test_the_groups_bench_table_puts_the_modes_side_by_side():
    from actors.tools.bench.groups.bench import mode_rows

    def update(seconds, link, trainer, peer):
        return {"seconds": seconds, "trainer_bytes": trainer, "peer_bytes": peer,
                "link_in": {"site0": link, "site1": link - 10}, "verified": True}

    result = {"modes": [
        {"mode": "direct", "updates": [update(2.0, 8_000_000, 16, 0), update(1.0, 8_000_000,
                                                                           16, 0)]},
        {"mode": "grouped", "updates": [update(1.0, 4_000_000, 8, 8)]}]}
    direct, grouped = mode_rows(result, Shaping(rate_mbit=40))
    assert direct["seconds"] == 1.5 and direct["best_seconds"] == 1.0
    assert direct["bound_seconds"] == 1.6 and grouped["bound_seconds"] == 0.8
    assert grouped["link_bytes"] == {"site0": 4_000_000, "site1": 3_999_990}
    assert grouped["peer_bytes"] == 8 and direct["verified"] and grouped["verified"]
