"""Real RDMA WRITEs through pyverbs: in-process loopback and a target in another process.

Needs an RDMA device (InfiniBand, RoCE or rxe): the ``rdma`` marker makes
tests/conftest.py skip with "pyverbs not importable: ..." or "no RDMA device:
..." without one. ``WT_RDMA_DEVICE`` and ``WT_RDMA_GID_INDEX`` choose the device and GID
(RoCE needs a GID that carries an address). The cross-process tests use
:class:`~actors.tools.testkit.harness.RemoteTarget`: a spawned process
registers the middle of a guarded buffer; the writer writes into it while the
target sleeps in read(2), and the test compares digests of the written range,
of the rest of the region and of the guards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os

import numpy as np
import pytest

from actors.tools.testkit.harness import GUARD_BYTE, RemoteTarget
from weight_transfer.transport import (
    PeerUnreachableError,
    RemoteAccessError,
    make_transport,
)

DEVICE = os.environ.get("WT_RDMA_DEVICE") or None
GID_INDEX = int(os.environ.get("WT_RDMA_GID_INDEX", "0"))
pytestmark = pytest.mark.rdma  # skipped by tests/conftest.py without pyverbs or a device

MiB = 1 << 20
GUARD = 4096
OPTS = {"device": DEVICE, "gid_index": GID_INDEX}


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sha(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def filled(n: int) -> str:
    return sha(bytes([GUARD_BYTE]) * n)


@pytest.fixture
def writer():
    nic = make_transport("rdma", owner="writer", nic="w0", chunk_bytes=256 * 1024,
                         max_inflight=4, timeout=12, retry_cnt=3, **OPTS)
    yield nic
    nic.close()


@pytest.fixture
def target():
    with RemoteTarget("rdma", nbytes=8 * MiB, guard_bytes=GUARD, owner="target",
                      peer_owner="writer", transport_opts={"nic": "t0", **OPTS}) as t:
        yield t


def connect_pair(writer, target) -> None:
    writer.connect(target.peer_info)
    target.connect(writer.peer_info("target"))


def test_cross_process_write_lands_exactly_while_the_target_sleeps(writer, target):
    connect_pair(writer, target)
    data = random_bytes(3 * MiB + 12_345, seed=1)
    offset = 777_777
    with target.blocked():  # the target runs no code during the writes
        asyncio.run(writer.write(data, target.region, offset))
    assert target.digest(offset, data.nbytes) == sha(data)
    assert target.digest(0, offset) == filled(offset)
    rest = target.nbytes - offset - data.nbytes
    assert target.digest(offset + data.nbytes, rest) == filled(rest)
    assert target.read(-GUARD, GUARD) == bytes([GUARD_BYTE]) * GUARD
    assert target.read(target.nbytes, GUARD) == bytes([GUARD_BYTE]) * GUARD
    assert writer.peak_inflight == 4  # 13 chunks of 256 KiB through a window of 4


def test_concurrent_writes_from_registered_and_unregistered_sources(writer, target):
    connect_pair(writer, target)
    staged = random_bytes(2 * MiB, seed=2)
    writer.register(staged)  # posts with this MR's lkey
    loose = [random_bytes(MiB + i, seed=10 + i) for i in range(3)]  # registered per write

    async def main():
        await asyncio.gather(
            writer.write(staged, target.region, 0),
            *(writer.write(buf, target.region, (3 + 2 * i) * MiB) for i, buf in enumerate(loose)),
        )

    asyncio.run(main())
    assert target.digest(0, 2 * MiB) == sha(staged)
    for i, buf in enumerate(loose):
        assert target.digest((3 + 2 * i) * MiB, buf.nbytes) == sha(buf)
    assert writer.peak_inflight <= 4


def test_wrong_rkey_is_refused_and_both_sides_can_reconnect(writer, target):
    connect_pair(writer, target)
    before = target.digest(0, target.nbytes)
    wrong = dataclasses.replace(target.region, rkey=target.region.rkey ^ 0xFF)
    with pytest.raises(RemoteAccessError) as err:
        asyncio.run(writer.write(random_bytes(4096), wrong, 0))
    msg = str(err.value)
    assert "peer 'target'" in msg and wrong.describe() in msg and "remote access error" in msg
    assert target.digest(0, target.nbytes) == before
    with pytest.raises(PeerUnreachableError, match="failed earlier"):
        asyncio.run(writer.write(random_bytes(16), target.region, 0))
    connect_pair(writer, target)  # same PeerInfos: both QPs go RESET -> RTS again
    data = random_bytes(100_000, seed=3)
    asyncio.run(writer.write(data, target.region, 5))
    assert target.digest(5, data.nbytes) == sha(data)


def test_deregistered_region_is_refused(writer, target):
    connect_pair(writer, target)
    target.deregister()
    with pytest.raises(RemoteAccessError, match="peer 'target'"):
        asyncio.run(writer.write(random_bytes(8192), target.region, 0))
    assert target.digest(0, 8192) == filled(8192)


def test_out_of_range_write_is_refused_before_posting(writer, target):
    connect_pair(writer, target)
    with pytest.raises(RemoteAccessError, match="outside region"):
        asyncio.run(writer.write(random_bytes(4096), target.region, target.nbytes - 100))
    data = random_bytes(100, seed=4)  # the connection is still healthy
    asyncio.run(writer.write(data, target.region, target.nbytes - 100))
    assert target.read(target.nbytes - 100, 100) == data.tobytes()


def test_dead_target_is_unreachable(writer, target):
    connect_pair(writer, target)
    target.kill()
    with pytest.raises(PeerUnreachableError, match="peer 'target'"):
        asyncio.run(writer.write(random_bytes(MiB), target.region, 0))


def test_write_before_connect_and_misaddressed_peer_info(writer, target):
    with pytest.raises(PeerUnreachableError, match="not connected to peer target/"):
        asyncio.run(writer.write(random_bytes(16), target.region, 0))
    for_someone_else = target.get_peer_info("trainer/7")
    with pytest.raises(ValueError, match="made for 'trainer/7', not for 'writer'"):
        writer.connect(for_someone_else)


def test_one_transport_connected_to_itself():
    with make_transport("rdma", owner="self", chunk_bytes=64 * 1024, **OPTS) as nic:
        nic.connect(nic.peer_info("self"))
        dst = np.zeros(MiB, dtype=np.uint8)
        desc = nic.register(dst)
        src = random_bytes(MiB - 3, seed=5)
        asyncio.run(nic.write(src, desc, 3))
        assert np.array_equal(dst[3:], src) and not dst[:3].any()
        nic.deregister(desc)
        with pytest.raises(ValueError, match="not registered"):
            nic.deregister(desc)


@pytest.mark.gpu
def test_gpu_memory_through_dmabuf_mrs():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")
    with make_transport("rdma", owner="w", **OPTS) as w, \
            make_transport("rdma", owner="t", **OPTS) as t:
        w.connect(t.peer_info("w"))
        t.connect(w.peer_info("t"))
        gpu_dst = torch.zeros(MiB + 5, dtype=torch.uint8, device="cuda")[5:]  # not page-aligned
        desc = t.register(gpu_dst)
        src = random_bytes(MiB, seed=6)
        asyncio.run(w.write(src, desc, 0))  # CPU -> GPU
        assert np.array_equal(gpu_dst.cpu().numpy(), src)
        cpu_dst = np.zeros(MiB, dtype=np.uint8)
        back = t.register(cpu_dst)
        asyncio.run(w.write(gpu_dst, back, 0))  # GPU source, registered for the write
        assert np.array_equal(cpu_dst, src)
