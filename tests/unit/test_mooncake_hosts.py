"""Mooncake's TCP protocol across hosts: refused by default at setup, allowed within one
host, and allowed across hosts only with ``allow_unauthenticated: true`` and a warning
that names the risk. Pure: no Mooncake, no traffic (the hosts are HostIds)."""

from __future__ import annotations

import logging

import pytest

from actors.connections import Connector
from weight_transfer.transport.handshake import HostId
from weight_transfer.transport.mooncake.calls import _WARNED
from weight_transfer.transport.options import parse_transport
from weight_transfer.types import EngineRankMeta, EngineTensorMeta, RegionDesc, ShardSpec

A = HostId(hostname="node-a", address="10.0.0.1")
B = HostId(hostname="node-b", address="10.0.0.2")


def _engine(replica: str, rank: int) -> EngineRankMeta:
    region = RegionDesc(owner=f"{replica}/tp{rank}", nic="mc0", addr=4096, length=64, rkey=1,
                        transport="mooncake")
    return EngineRankMeta(replica=replica, rank=rank, node="n", nic="mc0",
                          shard=ShardSpec(tp_rank=rank, tp_size=1),
                          tensors=(EngineTensorMeta(name="w", shape=(64,), dtype="uint8",
                                                    region=region, offset=0),))


def _connector(options: dict, hosts: dict[str, HostId]) -> Connector:
    conn = Connector(parse_transport("mooncake", options, where="t"), call=None, gather=None)
    conn.hosts.update(hosts)
    return conn


def test_tcp_across_hosts_is_refused_by_default_naming_both_ends_and_the_option():
    conn = _connector({}, {"trainer0": A, "engine0/tp0": B})
    with pytest.raises(ValueError) as err:
        conn.check_engines([0], [_engine("engine0", 0)])
    msg = str(err.value)
    assert "trainer0 on node-a (10.0.0.1) -> engine0/tp0 on node-b (10.0.0.2)" in msg
    assert "allow_unauthenticated: true" in msg
    assert "handshake port gives the registered buffers' addresses" in msg
    assert "reads and writes registered engine memory" in msg


def test_tcp_within_one_host_stays_allowed():
    _connector({}, {"trainer0": A, "engine0/tp0": A}).check_engines([0], [_engine("engine0", 0)])


def test_allow_unauthenticated_lets_tcp_cross_hosts_with_a_warning_that_names_the_risk(caplog):
    _WARNED.clear()
    conn = _connector({"allow_unauthenticated": True}, {"trainer0": A, "engine0/tp0": B})
    with caplog.at_level(logging.WARNING):
        conn.check_engines([0], [_engine("engine0", 0)])
        conn.check_engines([0], [_engine("engine0", 0)])  # warned once per pair of hosts
    warnings = [r.getMessage() for r in caplog.records if "allow_unauthenticated" in r.getMessage()]
    assert len(warnings) == 1
    assert "node-a (10.0.0.1) -> node-b (10.0.0.2)" in warnings[0]
    assert "authenticates nothing" in warnings[0] and "reads and writes" in warnings[0]


def test_the_option_is_a_strict_boolean():
    with pytest.raises(ValueError, match=r"transport_options\.allow_unauthenticated"):
        parse_transport("mooncake", {"allow_unauthenticated": "yes"}, where="TransferConfig")
