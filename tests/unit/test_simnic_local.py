"""SimNic writes inside one process (loopback): bytes, protection, link model, faults.

The writer and the target are separate SimNic objects; the write still goes
through the target's shared region table and ``process_vm_writev``.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import time

import numpy as np
import pytest
import torch

from weight_transfer.transport import PeerUnreachableError, RemoteAccessError, TransportError

N = 1 << 20
FILL = 0x5C


@pytest.fixture
def pair(make_simnic):
    """(target NIC, writer NIC, target buffer, its region); the writer is connected."""

    def build(n: int = N, **writer_kwargs):
        target = make_simnic(owner="engine0", nic="t0")
        writer = make_simnic(owner="trainer0", nic="w0", **writer_kwargs)
        buf = np.full(n, FILL, np.uint8)
        desc = target.register(buf)
        writer.connect(target.peer_info("trainer0"))
        return target, writer, buf, desc

    return build


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def untouched(buf: np.ndarray) -> bool:
    return bool((buf == FILL).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("numel,offset", [(1, 0), (333, 1), (4097, 4095), (100_003, 7)])
def test_tensor_bytes_land_exactly(pair, dtype, numel, offset):
    _, writer, buf, desc = pair(chunk_bytes=64 * 1024)
    src = (torch.randn(numel) * 50).to(dtype)
    asyncio.run(writer.write(src, desc, offset))
    n = src.numel() * src.element_size()
    assert buf[offset : offset + n].tobytes() == as_bytes(src)
    assert untouched(buf[:offset]) and untouched(buf[offset + n :])
    assert (writer.bytes_written, writer.writes) == (n, 1)


def test_other_sources_and_the_end_of_the_region(pair):
    _, writer, buf, desc = pair()
    arr = np.arange(1000, dtype=np.int16)
    cbuf = ctypes.create_string_buffer(b"raw range", 9)

    async def main():
        await writer.write(arr, desc, 0)
        await writer.write(b"bytes!", desc, 5000)
        await writer.write((ctypes.addressof(cbuf), 9), desc, N - 9)  # last byte of region
        await writer.write(b"", desc, N)  # empty write at the very end: allowed, no bytes

    asyncio.run(main())
    assert buf[:2000].tobytes() == arr.tobytes()
    assert buf[5000:5006].tobytes() == b"bytes!"
    assert buf[N - 9 :].tobytes() == b"raw range"
    assert untouched(buf[2000:5000]) and untouched(buf[5006 : N - 9])
    assert (writer.writes, writer.bytes_written) == (4, 2000 + 6 + 9)


def refused(writer, desc, offset, exc, *needles, n=100):
    with pytest.raises(exc) as err:
        asyncio.run(writer.write(np.ones(n, np.uint8), desc, offset))
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    return err.value


def test_wrong_rkey_is_refused_and_writes_nothing(pair):
    _, writer, buf, desc = pair()
    for rkey in (desc.rkey ^ 0x8000_0000, desc.rkey ^ 1, 0):  # same slot, other slot, zero
        bad = dataclasses.replace(desc, rkey=rkey)
        refused(writer, bad, 0, RemoteAccessError, bad.describe(), "peer engine0/t0",
                "wrong rkey or deregistered")
    assert untouched(buf) and writer.bytes_written == 0


def test_out_of_bounds_is_refused_at_both_ends_and_writes_nothing(pair):
    _, writer, buf, desc = pair()
    refused(writer, desc, N - 99, RemoteAccessError, desc.describe(), "offset")  # past the end
    refused(writer, desc, -1, RemoteAccessError, desc.describe())  # before the start
    # Forged descriptors pass the writer's own check; the target's table refuses them.
    longer = dataclasses.replace(desc, length=N + 4096)
    refused(writer, longer, N - 50, RemoteAccessError, "outside the registered", "engine0/t0")
    earlier = dataclasses.replace(desc, addr=desc.addr - 64, length=N + 64)
    refused(writer, earlier, 0, RemoteAccessError, "outside the registered")
    huge = dataclasses.replace(desc, length=2**70)
    refused(writer, huge, 2**64 - desc.addr - 10, RemoteAccessError, "outside the registered")
    assert untouched(buf) and writer.bytes_written == 0


def test_deregistered_region_is_refused_and_writes_nothing(pair):
    target, writer, buf, desc = pair()
    target.deregister(desc)
    refused(writer, desc, 0, RemoteAccessError, desc.describe(), "deregistered", "engine0/t0")
    again = target.register(buf)  # same memory, new key; the old key stays dead
    assert again.rkey != desc.rkey
    refused(writer, desc, 0, RemoteAccessError, "deregistered")
    assert untouched(buf)
    asyncio.run(writer.write(b"ok", again, 0))
    assert buf[:2].tobytes() == b"ok"


def test_unconnected_peer_is_unreachable(pair, make_simnic):
    _, _, buf, desc = pair()
    stranger = make_simnic(owner="trainer9")
    refused(stranger, desc, 0, PeerUnreachableError, "NIC trainer9/nic0 is not connected",
            "peer engine0/t0", desc.describe())
    unknown = dataclasses.replace(desc, owner="engine7")
    _, writer, _, _ = pair()
    refused(writer, unknown, 0, PeerUnreachableError, "not connected to peer engine7/t0")
    refused(writer, dataclasses.replace(desc, transport="rdma"), 0, ValueError, "'rdma'")
    assert untouched(buf)


def test_link_down_at_either_end(pair):
    target, writer, buf, desc = pair()
    writer.set_link(False)
    refused(writer, desc, 0, PeerUnreachableError, "link of NIC trainer0/w0 is down",
            desc.describe())
    writer.set_link(True)
    target.set_link(False)
    refused(writer, desc, 0, PeerUnreachableError, "link of peer engine0/t0", desc.describe())
    assert untouched(buf)
    target.set_link(True)
    asyncio.run(writer.write(b"up", desc, 0))
    assert buf[:2].tobytes() == b"up"


def test_a_target_that_closed_its_nic_is_unreachable(pair):
    target, writer, buf, desc = pair()
    target.close()
    err = refused(writer, desc, 0, PeerUnreachableError, "engine0/t0")
    assert "closed its NIC" in str(err) or "deregistered" in str(err)
    assert untouched(buf)


@pytest.mark.parametrize("budget", [0, 1, 4096, 10_000, 12_288])
def test_fail_after_bytes_delivers_exactly_that_many(pair, budget):
    _, writer, buf, desc = pair(chunk_bytes=4096)
    src = np.random.default_rng(budget).integers(0, 256, 20_000, dtype=np.uint8)
    writer.fail_after_bytes(budget)
    with pytest.raises(TransportError, match=f"byte budget used up.*stopped after {budget} B"):
        asyncio.run(writer.write(src, desc, 100))
    assert buf[100 : 100 + budget].tobytes() == src[:budget].tobytes()
    assert untouched(buf[:100]) and untouched(buf[100 + budget :])
    assert (writer.bytes_written, writer.writes) == (budget, 0)
    with pytest.raises(TransportError, match="stopped after 0 B"):  # the NIC stays failed
        asyncio.run(writer.write(b"more", desc, 0))
    assert untouched(buf[:100])
    writer.fail_after_bytes(None)
    asyncio.run(writer.write(src, desc, 100))
    assert buf[100:20_100].tobytes() == src.tobytes()


def test_a_write_within_the_budget_succeeds(pair):
    _, writer, buf, desc = pair(chunk_bytes=4096)
    writer.fail_after_bytes(10_000)
    asyncio.run(writer.write(b"x" * 10_000, desc, 0))  # exactly the budget: fine
    assert writer.writes == 1 and buf[:10_000].tobytes() == b"x" * 10_000
    with pytest.raises(ValueError, match="fail_after_bytes"):
        writer.fail_after_bytes(-1)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_max_inflight_bounds_writes_in_flight(pair, limit):
    _, writer, buf, desc = pair(max_inflight=limit, chunk_bytes=4096, inline_bytes=0)
    rng = np.random.default_rng(limit)
    parts = [rng.integers(0, 256, 50_000, dtype=np.uint8) for _ in range(8)]

    async def main():
        await asyncio.gather(*(writer.write(p, desc, i * 50_000) for i, p in enumerate(parts)))

    asyncio.run(main())
    # All eight start in the same loop turn: exactly `limit` get in, the rest wait.
    assert writer.peak_inflight == limit
    assert (writer.inflight, writer.writes, writer.bytes_written) == (0, 8, 400_000)
    assert buf[:400_000].tobytes() == b"".join(p.tobytes() for p in parts)


def test_small_writes_run_inline_and_stay_bounded(pair):
    _, writer, buf, desc = pair(max_inflight=3)  # 100 B writes take the inline path

    async def main():
        await asyncio.gather(*(writer.write(bytes([i]) * 100, desc, 100 * i) for i in range(50)))

    asyncio.run(main())
    assert all((buf[100 * i : 100 * i + 100] == i).all() for i in range(50))
    assert 1 <= writer.peak_inflight <= 3 and writer.writes == 50


def test_bandwidth_cap_slows_a_write_down(pair):
    _, writer, buf, desc = pair(n=64 << 20, bandwidth_gbps=0.5)
    src = np.ones(64 << 20, np.uint8)
    start = time.monotonic()
    asyncio.run(writer.write(src, desc, 0))
    assert time.monotonic() - start >= 0.1  # 64 MiB / 0.5 GB/s = 0.134 s at least
    assert (buf == 1).all()


def test_bandwidth_cap_is_shared_by_concurrent_writes(pair):
    _, writer, _, desc = pair(n=8 << 20, bandwidth_gbps=0.1, chunk_bytes=1 << 20)
    half = np.ones(4 << 20, np.uint8)

    async def main():
        await asyncio.gather(writer.write(half, desc, 0), writer.write(half, desc, 4 << 20))

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start >= 0.08  # 8 MiB / 0.1 GB/s = 0.084 s through one NIC


def test_latency_is_added_to_every_write(pair):
    _, writer, _, desc = pair(latency_us=20_000)

    async def main():
        for i in range(5):
            await writer.write(b"x", desc, i)

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start >= 0.09  # 5 x 20 ms, with room for timer rounding
    assert writer.writes == 5


def test_several_nics_per_process_have_their_own_tables(make_simnic):
    targets = [make_simnic(owner="engine0", nic=f"nic{i}") for i in range(3)]
    writers = [make_simnic(owner="trainer0", nic=f"w{i}") for i in range(2)]
    bufs = [np.zeros(4096, np.uint8) for _ in targets]
    descs = [t.register(b) for t, b in zip(targets, bufs, strict=True)]
    for w in writers:
        for t in targets:
            w.connect(t.peer_info(w.owner))

    async def main():
        await asyncio.gather(*(writers[i % 2].write(bytes([i + 1]) * 100, d, 10 * i)
                               for i, d in enumerate(descs)))

    asyncio.run(main())
    for i, b in enumerate(bufs):
        assert (b[10 * i : 10 * i + 100] == i + 1).all() and not b[: 10 * i].any()
    assert writers[0].bytes_written == 200 and writers[1].bytes_written == 100
    # nic1's rkey means nothing to nic2's table.
    forged = dataclasses.replace(descs[1], nic="nic2", addr=descs[2].addr)
    with pytest.raises(RemoteAccessError, match="peer engine0/nic2"):
        asyncio.run(writers[0].write(b"z", forged, 0))
    assert not bufs[2][:10].any()


async def wait_for(cond, what: str) -> None:
    for _ in range(100_000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


def test_once_deregister_returns_no_byte_lands(pair):
    target, writer, buf, desc = pair(n=4 << 20, bandwidth_gbps=0.01, chunk_bytes=64 * 1024)

    async def main():
        write = asyncio.create_task(writer.write(np.ones(4 << 20, np.uint8), desc, 0))
        await wait_for(lambda: writer.bytes_written >= 64 * 1024, "first chunk")
        target.deregister(desc)  # the write is still far from done
        snapshot = buf.copy()
        with pytest.raises(RemoteAccessError, match="deregistered"):
            await write
        return snapshot

    snapshot = asyncio.run(main())
    assert (buf == snapshot).all()
    landed = int((buf == 1).sum())
    assert landed == writer.bytes_written and 0 < landed < 4 << 20


def test_cancelling_a_write_stops_its_worker(pair):
    _, writer, buf, desc = pair(bandwidth_gbps=0.001, chunk_bytes=4096)

    async def main():
        write = asyncio.create_task(writer.write(np.ones(N, np.uint8), desc, 0))
        await wait_for(lambda: writer.bytes_written > 0, "first chunk")
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write

    asyncio.run(main())
    writer.close()  # waits for the worker, which stops at its next chunk
    assert 0 < writer.bytes_written < N and writer.writes == 0
    assert int((buf == 1).sum()) == writer.bytes_written


def test_closing_the_writer_aborts_a_slow_write(pair):
    _, writer, _, desc = pair(bandwidth_gbps=0.001, chunk_bytes=4096)

    async def main():
        write = asyncio.create_task(writer.write(np.ones(N, np.uint8), desc, 0))
        await wait_for(lambda: writer.bytes_written > 0, "first chunk")
        writer.close()
        with pytest.raises(TransportError, match="NIC trainer0/w0 closed during the write"):
            await write

    asyncio.run(main())
    with pytest.raises(TransportError, match="is closed"):
        asyncio.run(writer.write(b"x", desc, 0))
