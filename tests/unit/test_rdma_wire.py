"""RDMA connection data: PeerInfo validation, msgpack round trip, QP attributes."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from weight_transfer.transport.rdma.wire import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_WRITE,
    MTU_ENUM,
    RdmaEndpoint,
    build_qp_attrs,
    decode_peer,
    encode_peer,
    make_peer_info,
    normalize_gid,
    parse_endpoint,
)
from weight_transfer.types import PeerInfo

GID_A = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
GID_B = "fe80:0000:0000:0000:0202:c9ff:fe00:0002"


def endpoint(**kw) -> RdmaEndpoint:
    base = dict(lid=7, gid=GID_A, qpn=0x1234, psn=0xABCDE, port=1, mtu=4096, peer="trainer/0")
    return RdmaEndpoint(**{**base, **kw})


def info(**endpoint_kw) -> PeerInfo:
    return make_peer_info(owner="engine0/tp1", nic="mlx5_2", endpoint=endpoint(**endpoint_kw))


def test_endpoint_round_trips_through_peer_info():
    ep = endpoint()
    peer = make_peer_info(owner="engine0/tp1", nic="mlx5_2", endpoint=ep)
    assert peer.transport == "rdma"
    assert set(peer.endpoint) == {"lid", "gid", "qpn", "psn", "port", "mtu", "peer"}
    assert parse_endpoint(peer) == ep


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("qpn", 0, "'qpn' = 0 must be in [1, 16777215]"),
        ("qpn", 1 << 24, "'qpn' = 16777216 must be in [1, 16777215]"),
        ("psn", -1, "'psn' = -1 must be in [0, 16777215]"),
        ("lid", 0x10000, "'lid' = 65536 must be in [0, 65535]"),
        ("port", 0, "'port' = 0 must be in [1, 255]"),
        ("mtu", 1500, "'mtu' = 1500 must be one of [256, 512, 1024, 2048, 4096]"),
        ("qpn", "17", "'qpn' = '17' must be an integer"),
        ("psn", True, "'psn' = True must be an integer"),
        ("gid", "not-a-gid", "'gid': GID 'not-a-gid' is not a 128-bit address"),
        ("gid", 12, "'gid' = 12 must be a string"),
        ("peer", "", "'peer' = '' must name an owner"),
    ],
)
def test_bad_endpoint_field_is_named_with_the_sender(field, value, needle):
    good = info()
    bad = dataclasses.replace(good, endpoint={**good.endpoint, field: value})
    with pytest.raises(ValueError) as err:
        parse_endpoint(bad)
    assert needle in str(err.value)
    assert "'engine0/tp1'" in str(err.value) and "'mlx5_2'" in str(err.value)


def test_missing_fields_and_wrong_transport_are_refused():
    good = info()
    partial = dataclasses.replace(good, endpoint={"lid": 1, "gid": GID_A})
    with pytest.raises(ValueError, match=r"lacks \['qpn', 'psn', 'port', 'mtu', 'peer'\]"):
        parse_endpoint(partial)
    with pytest.raises(ValueError, match="is for transport 'simnic', not 'rdma'"):
        parse_endpoint(dataclasses.replace(good, transport="simnic"))


def test_gid_accepts_any_ipv6_notation_and_normalizes_to_pyverbs_format():
    assert normalize_gid("fe80::202:c9ff:fe00:1") == GID_A
    assert normalize_gid("::ffff:10.0.0.1") == "0000:0000:0000:0000:0000:ffff:0a00:0001"
    assert parse_endpoint(info(gid="FE80::202:C9FF:FE00:1")).gid == GID_A


def test_msgpack_round_trip_and_validation_on_decode():
    peer = info()
    assert decode_peer(encode_peer(peer)) == peer
    bad = msgpack.packb({"owner": "x", "nic": "n", "transport": "rdma", "endpoint": {"qpn": 1}})
    with pytest.raises(ValueError, match=r"PeerInfo from 'x'.*lacks"):
        decode_peer(bad)
    with pytest.raises(ValueError, match="must hold exactly"):
        decode_peer(msgpack.packb({"owner": "x"}))
    with pytest.raises(ValueError, match="not msgpack"):
        decode_peer(b"\xc1")
    other = PeerInfo(owner="a", nic="n", transport="simnic", endpoint={"pid": 3})
    assert decode_peer(encode_peer(other)) == other


def test_qp_attrs_cross_the_two_endpoints():
    local = endpoint(qpn=11, psn=100, mtu=4096, gid=GID_A, lid=3, peer="engine0")
    remote = endpoint(qpn=22, psn=200, mtu=1024, gid=GID_B, lid=4, peer="trainer/0")
    a = build_qp_attrs(local, remote, gid_index=3, roce=False)
    assert (a.dest_qp_num, a.rq_psn, a.sq_psn) == (22, 200, 100)
    assert a.path_mtu == MTU_ENUM[1024]  # the smaller MTU of the two ports
    assert (a.dlid, a.dgid, a.sgid_index, a.is_global) == (4, GID_B, 3, 1)
    assert a.access_flags == IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE
    assert a.port_num == local.port
    assert (a.timeout, a.retry_cnt, a.rnr_retry) == (14, 7, 7)


def test_qp_attrs_without_remote_gid_skip_the_grh_on_infiniband():
    zero = "0000:0000:0000:0000:0000:0000:0000:0000"
    a = build_qp_attrs(endpoint(), endpoint(gid=zero, lid=9), gid_index=0, roce=False)
    assert a.is_global == 0 and a.dlid == 9


def test_qp_attrs_refuse_unroutable_peers():
    zero = "0000:0000:0000:0000:0000:0000:0000:0000"
    with pytest.raises(ValueError, match=r"RoCE needs a GID on both sides.*gid_index 2"):
        build_qp_attrs(endpoint(), endpoint(gid=zero), gid_index=2, roce=True)
    with pytest.raises(ValueError, match=r"LID 0 on port 1.*subnet manager"):
        build_qp_attrs(endpoint(), endpoint(lid=0), gid_index=0, roce=False)
    ok = build_qp_attrs(endpoint(), endpoint(lid=0), gid_index=0, roce=True)
    assert ok.is_global == 1  # RoCE routes by GID; LID 0 is normal there


@pytest.mark.pyverbs
def test_enum_values_match_the_installed_pyverbs():
    import pyverbs.enums as e

    assert IBV_ACCESS_LOCAL_WRITE == e.IBV_ACCESS_LOCAL_WRITE
    assert IBV_ACCESS_REMOTE_WRITE == e.IBV_ACCESS_REMOTE_WRITE
    for nbytes, value in MTU_ENUM.items():
        assert getattr(e, f"IBV_MTU_{nbytes}") == value
