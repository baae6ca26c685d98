"""Mooncake transport in one process: two engines talking over loopback TCP.

Covers registration bookkeeping, descriptors, connect checks and the life
cycle; the cross-process data path is in test_mooncake_transfer.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from weight_transfer.transport import Transport, TransportError, make_transport
from weight_transfer.transport.base import PeerUnreachableError
from weight_transfer.transport.mooncake.transport import load_engine_class
from weight_transfer.types import PeerInfo

try:
    load_engine_class()
    MISSING = ""
except RuntimeError as exc:
    MISSING = str(exc)

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(bool(MISSING), reason=MISSING)]

OPTS = {"protocol": "tcp", "hostname": "127.0.0.1", "device_name": ""}


@pytest.fixture(scope="module")
def engines():
    # Shared: Mooncake serializes engine construction behind the ~1 s teardown of the last one.
    writer = make_transport("mooncake", owner="trainer0", nic="mc0", **OPTS)
    target = make_transport("mooncake", owner="engine0", nic="mc1", **OPTS)
    yield writer, target
    writer.close()
    target.close()


@pytest.fixture()
def pair(engines):
    yield engines
    for nic in engines:  # each test starts with no regions
        for desc in nic.regions():
            nic.deregister(desc)


def test_implements_the_transport_protocol(pair):
    writer, _ = pair
    assert isinstance(writer, Transport)
    assert (writer.kind, writer.owner, writer.nic) == ("mooncake", "trainer0", "mc0")


def test_register_returns_a_mooncake_descriptor_with_distinct_random_rkeys(pair):
    _, target = pair
    a, b = torch.zeros(4096, dtype=torch.uint8), np.zeros(1000, dtype=np.float32)
    da, db = target.register(a), target.register(b)
    assert (da.owner, da.nic, da.transport, da.node) == ("engine0", "mc1", "mooncake", "127.0.0.1")
    assert (da.addr, da.length) == (a.data_ptr(), 4096)
    assert (db.addr, db.length) == (b.ctypes.data, 4000)
    assert da.rkey != db.rkey and da.rkey and db.rkey
    assert set(target.regions()) == {da, db}
    target.deregister(da)
    assert target.regions() == [db]


def test_overlapping_and_unknown_regions_are_refused(pair):
    _, target = pair
    buf = torch.zeros(8192, dtype=torch.uint8)
    desc = target.register(buf[:4096])
    with pytest.raises(ValueError, match=r"overlaps region\(owner=engine0, nic=mc1"):
        target.register(buf[4000:])
    with pytest.raises(ValueError, match="cannot register an empty buffer"):
        target.register(buf[:0])
    with pytest.raises(ValueError, match=r"is not registered here"):
        target.deregister(dataclasses.replace(desc, rkey=desc.rkey ^ 1))
    target.deregister(desc)
    with pytest.raises(ValueError, match=r"is not registered here"):
        target.deregister(desc)
    target.register(buf[4000:])  # the range is free again


def test_peer_info_names_the_session_and_connect_checks_it(pair):
    writer, target = pair
    info = target.peer_info("trainer0")
    assert info.owner == "engine0" and info.nic == "mc1" and info.transport == "mooncake"
    assert info.endpoint == {"session_id": target.session_id, "protocol": "tcp"}
    writer.connect(info)
    bad = [
        (dataclasses.replace(info, transport="simnic"), ValueError, "for transport 'simnic'"),
        (dataclasses.replace(info, endpoint={}), ValueError, "session_id must be 'host:port'"),
        (dataclasses.replace(info, endpoint={**info.endpoint, "protocol": "rdma"}), ValueError,
         "peer speaks 'rdma', this NIC 'tcp'"),
        (PeerInfo(owner="ghost", nic="mc0", transport="mooncake",
                  endpoint={"session_id": "127.0.0.1:1"}),
         PeerUnreachableError, r"connect to ghost/mc0: handshake probe of 127\.0\.0\.1:1 failed"),
    ]
    for peer, error, match in bad:
        with pytest.raises(error, match=match):
            writer.connect(peer)


def test_write_in_process_and_empty_write(pair):
    writer, target = pair
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    desc = target.register(buf)
    writer.connect(target.peer_info("trainer0"))
    src = torch.arange(1000, dtype=torch.int32)
    asyncio.run(writer.write(src, desc, 12))
    asyncio.run(writer.write(b"", desc, 1 << 16))  # zero bytes at the end: allowed, no-op
    got = buf[12 : 12 + 4000].view(torch.int32)
    assert torch.equal(got, src)
    assert int(buf[:12].sum()) == 0 and int(buf[4012:].sum()) == 0


def test_rdma_protocol_refuses_unregistered_sources_before_sending(pair):
    """Checked without an RDMA device: the guard runs before any engine call."""
    writer, target = pair
    dst = torch.zeros(64, dtype=torch.uint8)
    desc = target.register(dst)
    writer.connect(target.peer_info("trainer0"))
    writer.protocol = "rdma"  # only the source check differs; the engine stays on TCP
    try:
        with pytest.raises(ValueError, match="sends only from registered memory"):
            asyncio.run(writer.write(torch.ones(4, dtype=torch.uint8), desc, 0))
        src = torch.full((16,), 3, dtype=torch.uint8)
        writer.register(src)
        asyncio.run(writer.write(src, desc, 0))
    finally:
        writer.protocol = "tcp"
    assert dst[:16].tolist() == [3] * 16 and int(dst[16:].sum()) == 0


def test_close_is_idempotent_and_later_calls_fail():
    writer = make_transport("mooncake", owner="trainer9", nic="mc0", **OPTS)
    target = make_transport("mooncake", owner="engine9", nic="mc0", **OPTS)
    desc = target.register(torch.zeros(64, dtype=torch.uint8))
    info = target.peer_info("trainer9")
    writer.close()
    writer.close()
    with pytest.raises(TransportError, match="mooncake trainer9/mc0 is closed"):
        asyncio.run(writer.write(torch.ones(4), desc, 0))
    with pytest.raises(TransportError, match="is closed"):
        writer.connect(info)
    with pytest.raises(TransportError, match="is closed"):
        writer.register(torch.zeros(4))
    target.close()
    assert target.regions() == []
