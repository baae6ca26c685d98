"""``wt selftest``: RDMA WRITE loopback on a real device, verified byte for byte, in GB/s.

Two :class:`~weight_transfer.transport.rdma.transport.RdmaTransport` endpoints open the
same device in this process, a writer and a target, each with the RC QP
dedicated to the other, so the bytes really leave through the NIC and come back:

1. open both endpoints (no pyverbs or no device: print why, exit 2);
2. the target registers a zeroed destination of ``size`` bytes, the writer a
   random source of the same size;
3. exchange ``peer_info`` and ``connect`` both sides;
4. one warm-up write, then ``repeats`` timed writes, the destination cleared
   before each one and compared with the source after each one (exit 1 on a
   mismatch, naming the first differing byte);
5. a write with a wrong rkey must fail with RemoteAccessError.

Prints a table with the device, the port, the sizes and the best and mean GB/s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from actors.tools.cli.sizes import format_size, parse_size
from weight_transfer.transport.base import RemoteAccessError
from weight_transfer.types import RegionDesc


def run(device: str | None, size: str, gid_index: int, *, repeats: int = 3,
        console: Console | None = None) -> int:
    """Run the loopback test; 0 on success, 1 on a failed or wrong write, 2 if it cannot run."""
    console = console or Console()
    try:
        nbytes = parse_size(size)
        writer, target = _open_pair(device, gid_index)
    except (RuntimeError, ValueError) as exc:
        console.print(Text(f"wt selftest: {exc}", style="red"), soft_wrap=True)
        return 2
    try:
        return _loopback(writer, target, nbytes, repeats, console)
    except (RuntimeError, ValueError) as exc:  # TransportError, failed QP transition
        console.print(Text(f"wt selftest: loopback failed: {exc}", style="red"), soft_wrap=True)
        return 1
    finally:
        writer.close()
        target.close()


def _open_pair(device: str | None, gid_index: int):
    from weight_transfer.transport.rdma.transport import RdmaTransport

    writer = RdmaTransport(owner="selftest/writer", device=device, gid_index=gid_index)
    try:
        target = RdmaTransport(owner="selftest/target", device=device, gid_index=gid_index)
    except BaseException:
        writer.close()
        raise
    return writer, target


def _loopback(writer, target, nbytes: int, repeats: int, console: Console) -> int:
    writer.connect(target.peer_info(writer.owner))
    target.connect(writer.peer_info(target.owner))
    src = np.frombuffer(np.random.default_rng().bytes(nbytes), dtype=np.uint8).copy()
    dst = np.zeros(nbytes, dtype=np.uint8)
    desc = target.register(dst)
    writer.register(src)
    seconds = asyncio.run(_timed_writes(writer, src, dst, desc, repeats))
    if isinstance(seconds, str):
        console.print(Text(f"wt selftest: {seconds}", style="red"), soft_wrap=True)
        return 1
    refused = asyncio.run(_wrong_rkey_refused(writer, src, desc))
    _report(console, writer, nbytes, seconds, refused)
    return 0 if refused else 1


async def _timed_writes(writer, src: np.ndarray, dst: np.ndarray, desc: RegionDesc,
                        repeats: int) -> list[float] | str:
    """Seconds of each timed write, or the description of the first mismatch."""
    seconds = []
    for i in range(repeats + 1):  # the first write is the warm-up
        dst.fill(0)
        start = time.perf_counter()
        await writer.write(src, desc, 0)
        elapsed = time.perf_counter() - start
        if not np.array_equal(src, dst):
            bad = int(np.flatnonzero(src != dst)[0])
            return (f"write {i}: destination differs from source at byte {bad} "
                    f"(wrote {src[bad]:#04x}, found {dst[bad]:#04x})")
        if i:
            seconds.append(elapsed)
    return seconds


async def _wrong_rkey_refused(writer, src: np.ndarray, desc: RegionDesc) -> bool:
    """A write with a wrong rkey must be refused by the target NIC."""
    wrong = dataclasses.replace(desc, rkey=desc.rkey ^ 0xFF)
    try:
        await writer.write(src[:4096], wrong, 0)
    except RemoteAccessError:
        return True
    return False


def _report(console: Console, writer, nbytes: int, seconds: list[float],
            refused: bool) -> None:
    port = writer.port_info
    table = Table(title="wt selftest: RDMA WRITE loopback")
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("device", f"{writer.device} port {writer.port} gid_index {writer.gid_index}"),
        ("link", f"{'RoCE' if port.roce else 'InfiniBand'}, MTU {port.mtu}, lid {port.lid}"),
        ("size", format_size(nbytes)),
        ("chunk / max in flight", f"{format_size(writer.chunk_bytes)} / {writer.max_inflight}"),
        ("peak in flight", str(writer.peak_inflight)),
        ("best GB/s", f"{nbytes / min(seconds) / 1e9:.2f}"),
        ("mean GB/s", f"{nbytes * len(seconds) / sum(seconds) / 1e9:.2f}"),
        ("bytes verified", f"{len(seconds) + 1} writes, all equal"),
        ("wrong rkey refused", "yes" if refused else "NO: the write went through"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
