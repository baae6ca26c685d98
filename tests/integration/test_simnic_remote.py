"""SimNic WRITEs into another process: exact bytes, guards intact, the target asleep.

Each target is a :class:`RemoteTarget` child holding a guarded, registered
buffer; the writer NIC lives in the test process.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from actors.tools.testkit.harness import GUARD_BYTE, RemoteTarget, proc_activity
from weight_transfer.transport.simnic.nic import SimNic

MiB = 1 << 20
GUARD = 64 * 1024
FILL = 0x3C


def sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


def random_tensor(nbytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of ``dtype`` for small sizes, random bit patterns for large ones."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    assert nbytes % size == 0
    if nbytes <= 4 * MiB:
        return (torch.randn(nbytes // size, generator=gen) * 100).to(dtype)
    bits = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return bits.view(dtype)


def guards_intact(target: RemoteTarget) -> bool:
    return (target.read(-GUARD, GUARD) == bytes([GUARD_BYTE]) * GUARD
            and target.read(target.nbytes, GUARD) == bytes([GUARD_BYTE]) * GUARD)


def filled(n: int) -> str:
    return sha(bytes([FILL]) * n)


@pytest.fixture(scope="module")
def target():
    with RemoteTarget("simnic", nbytes=80 * MiB, guard_bytes=GUARD, owner="engine0",
                      transport_opts={"nic": "t0"}) as t:
        yield t


@pytest.fixture
def writer(target):
    nic = SimNic(owner="trainer0", nic="w0")
    nic.connect(target.peer_info)
    target.fill(FILL)
    yield nic
    nic.close()


CASES = [  # (dtype, nbytes, offset): odd sizes and offsets, chunk edges, the region's end
    (torch.float8_e4m3fn, 1, 0),
    (torch.float8_e4m3fn, 3, 80 * MiB - 3),
    (torch.bfloat16, 2 * 4097, 1),
    (torch.bfloat16, 2 * (MiB + 3), 4095),
    (torch.float32, 4 * (2 * MiB + 1), 12_345),
    (torch.float8_e4m3fn, 8 * MiB + 1, 8 * MiB - 1),
    (torch.bfloat16, 64 * MiB - 2, 7),
    (torch.float32, 80 * MiB, 0),
]


@pytest.mark.parametrize("dtype,nbytes,offset", CASES)
def test_bytes_land_exactly_and_nothing_else_changes(target, writer, dtype, nbytes, offset):
    src = random_tensor(nbytes, dtype, seed=nbytes)
    asyncio.run(writer.write(src, target.region, offset))
    if nbytes <= MiB:
        assert target.read(offset, nbytes) == raw(src).tobytes()
    assert target.digest(offset, nbytes) == sha(raw(src))
    assert target.digest(0, offset) == filled(offset)
    rest = target.nbytes - offset - nbytes
    assert target.digest(offset + nbytes, rest) == filled(rest)
    assert guards_intact(target)
    assert (writer.bytes_written, writer.writes) == (nbytes, 1)


def test_256_mib_land_while_the_target_sleeps(make_target):
    """The target runs nothing during the writes: none of its threads is even scheduled."""
    big = make_target("simnic", nbytes=256 * MiB, guard_bytes=GUARD, owner="engine1")
    nic = SimNic(owner="trainer0", nic="w1")
    try:
        nic.connect(big.peer_info)
        src = random_tensor(256 * MiB, torch.bfloat16, seed=256)
        with big.blocked():
            before = proc_activity(big.pid)
            asyncio.run(nic.write(src, big.region, 0))
            asyncio.run(nic.write(src[: 3 * MiB], big.region, 5))
            after = proc_activity(big.pid)
        # A sleeping thread gains neither context switches nor CPU time; a thread that ran
        # any code (ours or the interpreter's) would have been switched in at least once.
        assert after.switches == before.switches
        assert after.cpu_ticks - before.cpu_ticks <= 1
        assert set(after.states) == {"S"}
        head = torch.cat([src.view(torch.uint8)[:5], src[: 3 * MiB].view(torch.uint8),
                          src.view(torch.uint8)[5 + 6 * MiB :]])
        assert big.digest(0, 256 * MiB) == sha(memoryview(head.numpy()))
        assert nic.bytes_written == 256 * MiB + 6 * MiB
        assert big.read(-GUARD, GUARD) == bytes([GUARD_BYTE]) * GUARD
    finally:
        nic.close()


def test_two_writer_nics_into_two_targets_concurrently(make_target):
    targets = [make_target("simnic", nbytes=16 * MiB, guard_bytes=GUARD, owner=f"engine{i}",
                           transport_opts={"nic": f"nic{i}", "max_inflight": 2})
               for i in range(2)]
    nics = [SimNic(owner="trainer0", nic=f"w{i}", chunk_bytes=MiB) for i in range(2)]
    try:
        for nic in nics:
            for t in targets:
                nic.connect(t.peer_info)
        parts = [random_tensor(4 * MiB, torch.float32, seed=i) for i in range(8)]

        async def main():
            await asyncio.gather(*(
                nics[i % 2].write(p, targets[i // 4].region, (i % 4) * 4 * MiB)
                for i, p in enumerate(parts)
            ))

        asyncio.run(main())
        for i, p in enumerate(parts):
            assert targets[i // 4].digest((i % 4) * 4 * MiB, 4 * MiB) == sha(raw(p))
        assert [n.bytes_written for n in nics] == [16 * MiB, 16 * MiB]
        assert all(n.peak_inflight == 4 for n in nics)
    finally:
        for nic in nics:
            nic.close()
