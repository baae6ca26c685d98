"""SimNic set-up: constructor checks, registration, peer info and connection errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from weight_transfer.transport import PeerUnreachableError, TransportError, make_transport
from weight_transfer.transport.simnic.nic import SimNic


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"owner": ""}, "owner"),
        ({"owner": 3}, "owner"),
        ({"nic": ""}, "nic"),
        ({"bandwidth_gbps": 0}, "bandwidth_gbps"),
        ({"bandwidth_gbps": -1.0}, "bandwidth_gbps"),
        ({"bandwidth_gbps": float("inf")}, "bandwidth_gbps"),
        ({"bandwidth_gbps": True}, "bandwidth_gbps"),
        ({"bandwidth_gbps": "1"}, "bandwidth_gbps"),
        ({"latency_us": -1}, "latency_us"),
        ({"latency_us": float("nan")}, "latency_us"),
        ({"max_inflight": 0}, "max_inflight"),
        ({"max_inflight": 2.0}, "max_inflight"),
        ({"chunk_bytes": 100}, "chunk_bytes"),
        ({"max_regions": 0}, "max_regions"),
        ({"inline_bytes": -1}, "inline_bytes"),
        ({"max_regions": 3}, "max_regions"),
        ({"max_regions": 1 << 21}, "max_regions"),
    ],
)
def test_bad_constructor_arguments_name_the_parameter(kwargs, name):
    args = {"owner": "engine0", **kwargs}
    with pytest.raises(ValueError, match=name):
        SimNic(**args)


def test_make_transport_builds_a_simnic_with_its_options(make_simnic):
    nic = make_transport("simnic", owner="engine0/tp1", nic="nic2", bandwidth_gbps=2.5,
                         latency_us=3, max_inflight=2, chunk_bytes=1 << 20)
    try:
        assert isinstance(nic, SimNic)
        assert (nic.owner, nic.nic, nic.bandwidth_gbps, nic.latency_us) == (
            "engine0/tp1", "nic2", 2.5, 3.0)
        assert (nic.max_inflight, nic.chunk_bytes) == (2, 1 << 20)
        assert (nic.bytes_written, nic.writes, nic.inflight, nic.peak_inflight) == (0, 0, 0, 0)
    finally:
        nic.close()


def test_register_describes_the_memory_with_a_random_rkey(make_simnic):
    nic = make_simnic(owner="engine0", nic="nic1", node="host7")
    t = torch.zeros(1000, dtype=torch.bfloat16)
    desc = nic.register(t)
    assert (desc.owner, desc.nic, desc.addr, desc.length) == ("engine0", "nic1", t.data_ptr(), 2000)
    assert (desc.transport, desc.node) == ("simnic", "host7")
    assert 0 < desc.rkey < 2**32
    rkeys = {nic.register(np.zeros(64, np.uint8)).rkey for _ in range(200)} | {desc.rkey}
    assert len(rkeys) == 201  # unique
    assert len({k >> 16 for k in rkeys}) > 150  # and the high bits vary: not a counter


def test_an_rkey_is_never_issued_twice(make_simnic):
    nic = make_simnic(max_regions=2)
    buf = np.zeros(64, np.uint8)
    seen = set()
    for _ in range(300):
        desc = nic.register(buf)
        assert desc.rkey not in seen
        seen.add(desc.rkey)
        nic.deregister(desc)


def test_register_rejects_bad_memory(make_simnic):
    nic = make_simnic()
    with pytest.raises(ValueError, match="empty buffer"):
        nic.register(bytearray())
    with pytest.raises(ValueError, match="read-only"):
        nic.register(b"abc")
    with pytest.raises(ValueError, match="not contiguous"):
        nic.register(torch.zeros(4, 4).t())


def test_a_full_region_table_is_a_transport_error(make_simnic):
    nic = make_simnic(owner="engine0", max_regions=2)
    buf = np.zeros(64, np.uint8)
    nic.register(buf)
    nic.register(buf)
    with pytest.raises(TransportError, match=r"NIC engine0/nic0.*all 2 region slots"):
        nic.register(buf)


def test_deregister_unknown_or_twice_names_the_region(make_simnic):
    nic = make_simnic(owner="engine0")
    other = make_simnic(owner="engine1")
    desc = nic.register(np.zeros(64, np.uint8))
    with pytest.raises(ValueError, match="is not registered on NIC engine0/nic0") as err:
        nic.deregister(dataclasses.replace(desc, length=32))
    assert "length=32" in str(err.value)
    with pytest.raises(ValueError, match="not registered"):
        other.deregister(desc)
    nic.deregister(desc)
    with pytest.raises(ValueError, match=r"region\(owner=engine0.*not registered"):
        nic.deregister(desc)


def test_peer_info_is_plain_data_naming_this_process(make_simnic):
    nic = make_simnic(owner="engine0", nic="nic3")
    info = nic.peer_info("trainer5")
    assert (info.owner, info.nic, info.transport) == ("engine0", "nic3", "simnic")
    assert set(info.endpoint) == {"pid", "start_time", "table_fd", "table_nonce", "boot_id",
                                  "pid_ns"}
    assert dataclasses.replace(info) == info  # frozen, comparable


def test_connect_checks_the_peer_info(make_simnic):
    target = make_simnic(owner="engine0")
    writer = make_simnic(owner="trainer0")
    info = target.peer_info("trainer0")
    with pytest.raises(ValueError, match="cannot connect to a 'rdma' endpoint"):
        writer.connect(dataclasses.replace(info, transport="rdma"))
    partial = {k: v for k, v in info.endpoint.items() if k != "table_fd"}
    with pytest.raises(ValueError, match=r"engine0/nic0 lacks \['table_fd'\]"):
        writer.connect(dataclasses.replace(info, endpoint=partial))
    elsewhere = {**info.endpoint, "boot_id": "another-machine"}
    with pytest.raises(PeerUnreachableError, match=r"engine0/nic0.*another host"):
        writer.connect(dataclasses.replace(info, endpoint=elsewhere))
    forged = {**info.endpoint, "table_nonce": "00" * 16}
    with pytest.raises(PeerUnreachableError, match="region table of peer engine0/nic0"):
        writer.connect(dataclasses.replace(info, endpoint=forged))
    writer.connect(info)
    writer.connect(info)  # idempotent


def test_connect_to_a_dead_or_recycled_pid_fails(make_simnic):
    target = make_simnic(owner="engine0")
    writer = make_simnic(owner="trainer0")
    info = target.peer_info("trainer0")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    gone = {**info.endpoint, "pid": int(done.stdout)}
    with pytest.raises(PeerUnreachableError, match="cannot connect to peer engine0/nic0"):
        writer.connect(dataclasses.replace(info, endpoint=gone))
    reused = {**info.endpoint, "start_time": info.endpoint["start_time"] - 1}
    with pytest.raises(PeerUnreachableError, match="was reused"):
        writer.connect(dataclasses.replace(info, endpoint=reused))


def test_a_closed_nic_refuses_everything_and_closes_once(make_simnic):
    nic = make_simnic(owner="engine0")
    desc = nic.register(np.zeros(64, np.uint8))
    info = nic.peer_info("x")
    nic.close()
    nic.close()
    for call in (lambda: nic.register(bytearray(8)), lambda: nic.deregister(desc),
                 lambda: nic.peer_info("x"), lambda: nic.connect(info)):
        with pytest.raises(TransportError, match="NIC engine0/nic0 is closed"):
            call()
