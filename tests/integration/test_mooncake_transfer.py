"""Mooncake over TCP between two processes on loopback.

A spawned target process registers the middle of a guarded buffer (guard bytes
on both sides) with its own MooncakeTransport and answers fill/read/digest
commands over a Pipe; this process writes into it. Every check compares the
whole remote buffer, guards included, with a local mirror of what it must hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

from weight_transfer.transport import PeerUnreachableError, RemoteAccessError, make_transport
from weight_transfer.transport.mooncake import load_engine_class

try:
    load_engine_class()
    MISSING = ""
except RuntimeError as exc:
    MISSING = str(exc)

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(bool(MISSING), reason=MISSING)]

MiB = 1 << 20
GUARD = 4096
FILL = 0xA5
REGION = 256 * MiB
OPTS = {"protocol": "tcp", "hostname": "127.0.0.1", "device_name": ""}


def _target_main(conn, nbytes: int, guard: int) -> None:
    """The target process: register buf[guard:guard+nbytes], then serve commands."""
    from weight_transfer.transport import make_transport as make

    nic = make("mooncake", owner="engine0/tp0", nic="mc0", **OPTS)
    buf = np.full(guard + nbytes + guard, FILL, dtype=np.uint8)
    desc = nic.register(buf[guard : guard + nbytes])
    conn.send(("ok", (desc, nic.peer_info("trainer0"))))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "fill":
                buf[:] = FILL
                out = None
            elif cmd == "read":
                out = bytes(buf[args[0] : args[1]])
            elif cmd == "digest":
                out = hashlib.sha256(buf).hexdigest()
            elif cmd == "deregister":
                out = nic.deregister(desc)
            elif cmd == "stop":
                nic.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as exc:  # report to the test instead of dying silently
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Target:
    """Handle on a target process and a local mirror of its whole buffer."""

    def __init__(self, nbytes: int, guard: int = GUARD) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(child, nbytes, guard), daemon=True)
        self.proc.start()
        child.close()
        self.guard = guard
        self.desc, self.peer = self.ask(None)
        self.mirror = np.full(guard + nbytes + guard, FILL, dtype=np.uint8)

    def ask(self, cmd, *args, timeout: float = 120.0):
        if cmd is not None:
            self.conn.send((cmd, *args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"target pid {self.proc.pid} did not answer {cmd!r}")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"target failed {cmd!r}: {value}")
        return value

    def wrote(self, offset: int, data: np.ndarray) -> None:
        start = self.guard + offset
        self.mirror[start : start + data.nbytes] = data

    def assert_holds_mirror(self, edges: tuple[int, int] | None = None) -> None:
        """Edge windows first (readable diffs), then the whole buffer by digest."""
        if edges is not None:
            lo, hi = self.guard + edges[0], self.guard + edges[1]
            for a, b in ((lo - 64, lo + 64), (hi - 64, hi + 64)):
                a, b = max(a, 0), min(b, self.mirror.nbytes)
                assert self.ask("read", a, b) == self.mirror[a:b].tobytes(), f"bytes {a}..{b}"
        assert self.ask("digest") == hashlib.sha256(self.mirror).hexdigest()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
                self.ask("stop", timeout=30)
            self.proc.kill()
        self.proc.join(30)


@pytest.fixture(scope="module")
def target():
    t = Target(REGION)
    yield t
    t.close()


@pytest.fixture()
def small_target():
    t = Target(MiB)
    yield t
    t.close()


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
        with pytest.raises(PeerUnreachableError, match=r"not connected to engine0/tp0/mc0"):
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


@pytest.mark.timeout(120)
def test_deregistered_region_refuses_writes(small_target):
    nic = make_transport("mooncake", owner="trainer3", nic="mc0", **OPTS)
    nic.connect(small_target.peer)
    src = random_tensor(torch.float32, 256, seed=5)
    asyncio.run(nic.write(src, small_target.desc, 0))
    small_target.wrote(0, as_bytes(src))
    small_target.ask("deregister")
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
    small_target.proc.kill()
    small_target.proc.join(30)
    gone = r"region\(owner=engine0/tp0.* to engine0/tp0/mc0 at .*the peer does not answer"
    with pytest.raises(PeerUnreachableError, match=gone):
        asyncio.run(nic.write(src, small_target.desc, 0))
    with pytest.raises(PeerUnreachableError, match=r"handshake probe of 127\.0\.0\.1:\d+ failed"):
        nic.connect(small_target.peer)
    nic.close()


@pytest.mark.timeout(120)
def test_write_to_stopped_process_times_out_then_close_returns(small_target):
    nic = make_transport("mooncake", owner="trainer5", nic="mc0", timeout_s=1.0, **OPTS)
    nic.connect(small_target.peer)
    src = random_tensor(torch.float32, 4096, seed=13)
    asyncio.run(nic.write(src, small_target.desc, 0))  # opens the session
    os.kill(small_target.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(PeerUnreachableError, match=r"did not complete within 1\.\d+s"):
            asyncio.run(nic.write(src, small_target.desc, 0))
        assert time.monotonic() - started < 60  # bounded: our deadline, not Mooncake's
    finally:
        os.kill(small_target.proc.pid, signal.SIGKILL)
        small_target.proc.join(30)
    nic.close()
    nic.close()
