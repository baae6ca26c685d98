"""Mooncake over TCP between two processes on loopback.

The target is a :class:`RemoteTarget` child (harness.py) holding a guarded
buffer registered with its own MooncakeTransport; this process writes into it.
Every check compares the whole remote buffer, guards included, with a local
mirror of what it must hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.tools.testkit.harness import GUARD_BYTE, RemoteTarget
from weight_transfer.transport import PeerUnreachableError, RemoteAccessError, make_transport
from weight_transfer.transport.mooncake.transport import load_engine_class

try:
    load_engine_class()
    MISSING = ""
except RuntimeError as exc:
    MISSING = str(exc)

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(bool(MISSING), reason=MISSING)]

MiB = 1 << 20
GUARD = 4096
REGION = 256 * MiB
OPTS = {"protocol": "tcp", "hostname": "127.0.0.1", "device_name": ""}


class Mirrored:
    """A RemoteTarget and a local mirror of its whole buffer, guards included."""

    def __init__(self, target: RemoteTarget) -> None:
        self.remote = target
        self.desc, self.peer = target.region, target.peer_info
        self.mirror = np.full(GUARD + target.nbytes + GUARD, GUARD_BYTE, dtype=np.uint8)

    def wrote(self, offset: int, data: np.ndarray) -> None:
        self.mirror[GUARD + offset : GUARD + offset + data.nbytes] = data

    def assert_holds_mirror(self, edges: tuple[int, int] | None = None) -> None:
        """Edge windows first (readable diffs), then the whole buffer by digest."""
        for edge in edges or ():
            a, b = max(edge - 64, -GUARD), min(edge + 64, self.remote.nbytes + GUARD)
            want = self.mirror[GUARD + a : GUARD + b].tobytes()
            assert self.remote.read(a, b - a) == want, f"bytes {a}..{b} of the region"
        got = self.remote.digest(-GUARD, self.mirror.nbytes)
        assert got == hashlib.sha256(self.mirror).hexdigest(), "the remote buffer differs"


def start_target(nbytes: int) -> RemoteTarget:
    target = RemoteTarget("mooncake", nbytes=nbytes, guard_bytes=GUARD, owner="engine0/tp0",
                          peer_owner="trainer0", transport_opts={"nic": "mc0", **OPTS})
    target.start()
    return target


@pytest.fixture(scope="module")
def target():
    remote = start_target(REGION)
    yield Mirrored(remote)
    remote.close()


@pytest.fixture()
def small_target():
    remote = start_target(MiB)
    yield Mirrored(remote)
    remote.close()


@pytest.fixture(scope="module")
def writer(target):
    nic = make_transport("mooncake", owner="trainer0", nic="mc0", **OPTS)
    nic.connect(target.peer)
    yield nic
    nic.close()


def random_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).to(dtype)  # float8: a real e4m3 cast


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


CASES = [  # (dtype, elements, destination offset in bytes); offset -1: end at the region end
    (torch.float8_e4m3fn, 1, 0),
    (torch.bfloat16, 1, 9),
    (torch.float32, 1000, 4093),
    (torch.bfloat16, 3 * MiB + 5, 777),
    (torch.float8_e4m3fn, 64 * MiB, -1),
    (torch.float32, 64 * MiB, 0),  # 256 MiB: the whole region
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dtype", "numel", "offset"), CASES)
def test_bytes_land_exactly_and_nowhere_else(target, writer, dtype, numel, offset):
    src = random_tensor(dtype, numel, seed=numel)
    data = as_bytes(src)
    offset = REGION - data.nbytes if offset < 0 else offset
    asyncio.run(writer.write(src, target.desc, offset))
    target.wrote(offset, data)
    target.assert_holds_mirror(edges=(offset, offset + data.nbytes))


@pytest.mark.timeout(300)
def test_many_concurrent_chunked_writes(target):
    nic = make_transport("mooncake", owner="trainer1", nic="mc0", max_inflight=2,
                         chunk_bytes=MiB, **OPTS)
    nic.connect(target.peer)
    srcs = [random_tensor(torch.bfloat16, (2 * MiB + 3 * i) // 2, seed=100 + i) for i in range(6)]
    offsets = [5 * MiB * i + i for i in range(6)]

    async def all_writes():
        pairs = zip(srcs, offsets, strict=True)
        await asyncio.gather(*(nic.write(s, target.desc, o) for s, o in pairs))

    asyncio.run(all_writes())
    nic.close()
    for s, o in zip(srcs, offsets, strict=True):
        target.wrote(o, as_bytes(s))
    target.assert_holds_mirror()


def test_out_of_bounds_writes_fail_and_write_nothing(target, writer):
    src = random_tensor(torch.float32, 1024, seed=7)
    for offset in (REGION - 4095, REGION, -1):
        with pytest.raises(RemoteAccessError, match=r"outside region\(owner=engine0/tp0"):
            asyncio.run(writer.write(src, target.desc, offset))
    target.assert_holds_mirror()


def test_unconnected_writer_fails_and_writes_nothing(target):
    nic = make_transport("mooncake", owner="trainer2", nic="mc0", **OPTS)
    try:
        with pytest.raises(PeerUnreachableError, match=r"not connected to peer engine0/tp0/mc0"):
            asyncio.run(nic.write(torch.ones(16), target.desc, 0))
    finally:
        nic.close()
    target.assert_holds_mirror()


def test_bad_descriptors_fail_and_write_nothing(target, writer):
    src = random_tensor(torch.bfloat16, 4096, seed=3)
    foreign = dataclasses.replace(target.desc, transport="simnic")
    with pytest.raises(ValueError, match=r"belongs to transport 'simnic'"):
        asyncio.run(writer.write(src, foreign, 0))
    with pytest.raises(ValueError, match=r"RegionDesc"):
        asyncio.run(writer.write(src, {"addr": target.desc.addr}, 0))
    # A forged length passes the writer's check; the target's server refuses the range.
    forged = dataclasses.replace(target.desc, length=REGION + 2 * GUARD)
    with pytest.raises(RemoteAccessError, match=r"not inside a region the target has registered"):
        asyncio.run(writer.write(src, forged, REGION - 100))
    target.assert_holds_mirror()


def test_rkey_is_not_enforced_over_tcp(target, writer):
    """Documented limit: Mooncake has no remote keys, so a wrong rkey still writes."""
    src = random_tensor(torch.float32, 8, seed=11)
    wrong = dataclasses.replace(target.desc, rkey=target.desc.rkey ^ 0xFFFF)
    asyncio.run(writer.write(src, wrong, 64))
    target.wrote(64, as_bytes(src))
    target.assert_holds_mirror(edges=(64, 96))


def test_write_lands_while_the_target_sleeps_in_a_syscall(target, writer):
    """One-sided: the target's Python thread is blocked; Mooncake's own threads serve it."""
    src = random_tensor(torch.bfloat16, 4096, seed=21)
    with target.remote.blocked():
        asyncio.run(writer.write(src, target.desc, 1000))
    target.wrote(1000, as_bytes(src))
    target.assert_holds_mirror(edges=(1000, 1000 + 8192))


@pytest.mark.timeout(120)
def test_deregistered_region_refuses_writes(small_target):
    nic = make_transport("mooncake", owner="trainer3", nic="mc0", **OPTS)
    nic.connect(small_target.peer)
    src = random_tensor(torch.float32, 256, seed=5)
    asyncio.run(nic.write(src, small_target.desc, 0))
    small_target.wrote(0, as_bytes(src))
    small_target.remote.deregister()
    with pytest.raises(RemoteAccessError, match=r"engine0/tp0/mc0 at 127\.0\.0\.1:\d+: refused"):
        asyncio.run(nic.write(random_tensor(torch.float32, 256, seed=6), small_target.desc, 0))
    nic.close()
    small_target.assert_holds_mirror()


@pytest.mark.timeout(120)
def test_write_to_killed_process_fails_cleanly(small_target):
    nic = make_transport("mooncake", owner="trainer4", nic="mc0", **OPTS)
    nic.connect(small_target.peer)
    src = random_tensor(torch.bfloat16, 1024, seed=9)
    asyncio.run(nic.write(src, small_target.desc, 0))
    small_target.remote.kill()
    gone = r"region\(owner=engine0/tp0.* to engine0/tp0/mc0 at .*the peer does not answer"
    with pytest.raises(PeerUnreachableError, match=gone):
        asyncio.run(nic.write(src, small_target.desc, 0))
    with pytest.raises(PeerUnreachableError, match=r"handshake probe of 127\.0\.0\.1:\d+ failed"):
        nic.connect(small_target.peer)
    nic.close()


def _wait_stopped(pid: int, timeout_s: float = 30.0) -> None:
    """Until every thread of ``pid`` is stopped (state T in /proc): a loaded machine may run
    the target's I/O thread once more after SIGSTOP is sent, and answer a write."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for tid in os.listdir(f"/proc/{pid}/task")]
        if all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: {states}"
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_write_to_stopped_process_times_out_then_close_returns(small_target):
    nic = make_transport("mooncake", owner="trainer5", nic="mc0", timeout_s=1.0, **OPTS)
    nic.connect(small_target.peer)
    src = random_tensor(torch.float32, 4096, seed=13)
    asyncio.run(nic.write(src, small_target.desc, 0))  # opens the session
    os.kill(small_target.remote.pid, signal.SIGSTOP)
    _wait_stopped(small_target.remote.pid)  # a signal takes effect when the process is next run
    try:  # our deadline (1 s + bytes at 0.1 GB/s) fires, not Mooncake's 30 s progress timeout
        with pytest.raises(PeerUnreachableError, match=r"did not complete within 1\.\d+s"):
            asyncio.run(nic.write(src, small_target.desc, 0))
    finally:
        small_target.remote.kill()
    nic.close()
    nic.close()
