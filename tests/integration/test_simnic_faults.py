"""SimNic protection and failures across processes: refused writes change nothing.

Every refused write is checked against a digest of the whole region and its
guards taken before; every message must name the region and the peer.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from actors.tools.testkit.harness import GUARD_BYTE
from weight_transfer.transport import PeerUnreachableError, RemoteAccessError

MiB = 1 << 20
GUARD = 4096
PEER = "peer engine0/t0"


@pytest.fixture
def target(make_target):
    return make_target("simnic", nbytes=4 * MiB, guard_bytes=GUARD, owner="engine0",
                       transport_opts={"nic": "t0"})


@pytest.fixture
def writer(make_simnic, target):
    nic = make_simnic(owner="trainer0", nic="w0")
    nic.connect(target.peer_info)
    return nic


def everything(target) -> str:
    return target.digest(-GUARD, target.nbytes + 2 * GUARD)


def assert_refused(writer, target, desc, offset, exc, *needles, n=4096):
    before = everything(target)
    with pytest.raises(exc) as err:
        asyncio.run(writer.write(np.ones(n, np.uint8), desc, offset))
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert everything(target) == before
    assert writer.bytes_written == 0
    return err.value


def test_wrong_rkey(writer, target):
    for flip in (1 << 31, 1, 0xFFFF_FFFF):
        bad = dataclasses.replace(target.region, rkey=target.region.rkey ^ flip)
        assert_refused(writer, target, bad, 0, RemoteAccessError, bad.describe(), PEER,
                       "wrong rkey")


def test_out_of_bounds_at_both_ends_and_overflow(writer, target):
    region = target.region
    assert_refused(writer, target, region, target.nbytes - 4095, RemoteAccessError,
                   region.describe(), "outside")
    assert_refused(writer, target, region, -1, RemoteAccessError, region.describe())
    # Forged descriptors reach the guards only if the target's table lets them: it does not.
    low = dataclasses.replace(region, addr=region.addr - GUARD, length=region.length + GUARD)
    assert_refused(writer, target, low, 0, RemoteAccessError, "outside the registered", PEER)
    high = dataclasses.replace(region, length=region.length + GUARD)
    assert_refused(writer, target, high, target.nbytes - 1, RemoteAccessError,
                   "outside the registered", PEER)
    wrap = dataclasses.replace(region, length=2**65)
    assert_refused(writer, target, wrap, 2**64 - region.addr - 100, RemoteAccessError,
                   "outside the registered")


def test_deregistered_region(writer, target):
    target.deregister()
    assert_refused(writer, target, target.region, 0, RemoteAccessError,
                   target.region.describe(), PEER, "deregistered")


def test_not_connected_peer(make_simnic, target):
    stranger = make_simnic(owner="trainer1", nic="w1")
    assert_refused(stranger, target, target.region, 0, PeerUnreachableError,
                   "not connected to peer engine0/t0", target.region.describe())


def test_link_down_at_the_target(writer, target):
    target.call("set_link", False)
    assert_refused(writer, target, target.region, 0, PeerUnreachableError,
                   "link of peer engine0/t0", target.region.describe())
    target.call("set_link", True)
    asyncio.run(writer.write(b"\x01\x02", target.region, 0))
    assert target.read(0, 2) == b"\x01\x02"


def test_target_closed_its_nic(writer, target):
    target.call("close")
    assert_refused(writer, target, target.region, 0, PeerUnreachableError, PEER,
                   "closed its NIC", target.region.describe())


def test_errors_in_the_target_come_back_with_its_message(target):
    with pytest.raises(ValueError, match=r"outside region\+guards") as err:
        target.read(-GUARD - 1, 1)
    assert any("raised in target process" in note for note in err.value.__notes__)
    with pytest.raises(ValueError, match="is not registered on NIC engine0/t0"):
        target.deregister()
        target.deregister()


def test_dead_target(writer, target):
    target.kill()
    with pytest.raises(PeerUnreachableError) as err:
        asyncio.run(writer.write(np.ones(4096, np.uint8), target.region, 0))
    msg = str(err.value)
    assert PEER in msg and target.region.describe() in msg and "dead" in msg
    assert writer.bytes_written == 0


@pytest.mark.timeout(60)
def test_target_killed_during_a_long_capped_write(make_simnic, target):
    writer = make_simnic(owner="trainer0", nic="w0", bandwidth_gbps=0.002, chunk_bytes=64 * 1024)
    writer.connect(target.peer_info)

    async def main():
        write = asyncio.create_task(writer.write(np.ones(4 * MiB, np.uint8), target.region, 0))
        for _ in range(60_000):  # until the first chunk landed (bounded by the test timeout)
            if writer.bytes_written:
                break
            await asyncio.sleep(0.001)
        target.kill()
        with pytest.raises(PeerUnreachableError, match=r"engine0/t0.*(exited|dead)"):
            await write

    asyncio.run(main())  # 4 MiB at 2 MB/s would take 2 s; the kill ends it at once
    assert 0 < writer.bytes_written < 4 * MiB and writer.writes == 0


def test_deregister_during_a_write_stops_it(make_simnic, target):
    writer = make_simnic(owner="trainer0", nic="w0", bandwidth_gbps=0.005, chunk_bytes=64 * 1024)
    writer.connect(target.peer_info)

    async def main():
        write = asyncio.create_task(writer.write(np.ones(4 * MiB, np.uint8), target.region, 0))
        while not writer.bytes_written:
            await asyncio.sleep(0.001)
        target.deregister()  # returns once chunks in flight have landed
        frozen = everything(target)
        with pytest.raises(RemoteAccessError, match="deregistered"):
            await write
        return frozen

    frozen = asyncio.run(main())
    assert everything(target) == frozen
    landed = target.read(0, writer.bytes_written)
    assert landed == b"\x01" * writer.bytes_written
    assert target.read(writer.bytes_written, 1) == bytes([GUARD_BYTE])


def test_link_down_at_the_writer_mid_write(make_simnic, target):
    writer = make_simnic(owner="trainer0", nic="w0", bandwidth_gbps=0.005, chunk_bytes=64 * 1024)
    writer.connect(target.peer_info)

    async def main():
        write = asyncio.create_task(writer.write(np.ones(4 * MiB, np.uint8), target.region, 0))
        while not writer.bytes_written:
            await asyncio.sleep(0.001)
        writer.set_link(False)
        with pytest.raises(PeerUnreachableError, match="link of NIC trainer0/w0 is down"):
            await write

    asyncio.run(main())
    landed = writer.bytes_written
    assert 0 < landed < 4 * MiB
    assert target.read(0, landed) == b"\x01" * landed
    assert target.read(landed, 1) == bytes([GUARD_BYTE])
    with pytest.raises(PeerUnreachableError, match="is down"):
        asyncio.run(writer.write(b"x", target.region, 0))
    writer.set_link(True)
    asyncio.run(writer.write(b"\x07", target.region, landed))
    assert target.read(landed, 1) == b"\x07"
