"""Transport benchmark: GB/s of memcpy, simnic, Mooncake TCP and our tcp, side by side.

Run ``wt bench transport`` or, directly,
``python actors/tools/bench/transport.py --sizes 1M,64M,1G --repeats 5 --json out.json``.
For every size it reports the best of ``repeats`` timed copies of that size (the
backends take turns, so a busy machine slows them alike):

* ``memcpy``: ``ctypes.memmove`` between two pre-faulted buffers of this process,
  on one thread: the ceiling of a one-copy transfer on this machine;
* ``simnic``: an uncapped SimNic WRITE from a pre-faulted buffer here into a
  pre-faulted, registered region of ANOTHER process (a
  :class:`~actors.tools.testkit.harness.RemoteTarget` child);
* ``mooncake_tcp``: Mooncake's TransferEngine over TCP on loopback into a
  RemoteTarget child, when the ``mooncake`` extra is installed and works;
* ``tcp``, ``tcp_enc``, ``tcp_lz4``, ``tcp_zstd``: our authenticated ``tcp``
  transport on loopback into a RemoteTarget child (granted, window open):
  authenticated frames (GMAC), encrypted (AES-GCM), compressed with lz4 or zstd;

The source holds bf16 weights (a 16 MiB block of N(0, 0.02) values, repeated),
so that the compressed modes see what they would in an update. Also reported:
the cost of the tcp update window (open at the pause + close at the resume) per
update, measured on a NIC of this process.

and simnic as a percentage of memcpy (the target: >= 90% from 64 MiB up).
``--json PATH`` writes ``{"memcpy": {size: GBps}, "simnic": {...},
"mooncake_tcp": {...}, "unavailable": {backend: reason}}`` with sizes as string
keys; a backend that could not run has an empty table and a reason.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from actors.tools.cli.progress import command_console, emit_json, json_to_stdout, progress_bar
from actors.tools.cli.sizes import format_size, parse_sizes
from actors.tools.testkit.harness import RemoteTarget
from weight_transfer.sender.host_memory import alloc_buffer
from weight_transfer.transport import make_transport

BACKENDS = ("memcpy", "simnic", "mooncake_tcp", "tcp", "tcp_enc", "tcp_lz4", "tcp_zstd")
TCP_MODES = {"tcp": {}, "tcp_enc": {"encrypt": True}, "tcp_lz4": {"compression": "lz4"},
             "tcp_zstd": {"compression": "zstd"}}
REQUIRED = ("memcpy", "simnic")  # an optional backend that fails is reported, not fatal
Results = dict[int, float]


def parse_backends(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"backends: unknown {unknown or text!r}; choose from {list(BACKENDS)}")
    return names


class MemcpyBench:
    """``ctypes.memmove`` between two pre-faulted buffers of this process."""

    def __init__(self, nbytes: int, src: int) -> None:
        self.src = src
        self.mapping, _, self.dst = alloc_buffer(nbytes, fill=0)

    def once(self, size: int) -> float:
        start = time.perf_counter()
        ctypes.memmove(self.dst, self.src, size)
        return time.perf_counter() - start

    def close(self) -> None:
        self.mapping.close()


class NicBench:
    """WRITEs from this process into a region of a RemoteTarget child, one backend."""

    def __init__(self, kind: str, nbytes: int, src: int, opts: dict[str, Any],
                 symmetric: bool = False) -> None:
        self.src = src
        self.loop = asyncio.new_event_loop()
        self.nic: Any = None
        self.target: RemoteTarget | None = None
        try:
            self.nic = make_transport(kind, owner="bench-writer", nic=f"{kind}-w", **opts)
            self.target = RemoteTarget(kind, nbytes=nbytes, guard_bytes=0, owner="bench-target",
                                       peer_owner="bench-writer",
                                       transport_opts={"nic": f"{kind}-t", **opts})
            self.target.start()
            if kind == "tcp":  # the plan's grant and the update window, as at an update
                self.target.call("grant", "bench-writer", f"{kind}-w")
                self.target.call("open_window")
                self.nic.connect(self.target.call("peer_info", "bench-writer", f"{kind}-w"))
            else:
                self.nic.connect(self.target.peer_info)
            if symmetric:
                self.target.connect(self.nic.peer_info("bench-target"))
            self.once(4096)  # warm-up: worker threads, sessions
        except BaseException:
            self.close()
            raise

    async def _timed(self, size: int) -> float:
        start = time.perf_counter()
        await self.nic.write((self.src, size), self.target.region, 0)
        return time.perf_counter() - start

    def once(self, size: int) -> float:
        return self.loop.run_until_complete(self._timed(size))

    def close(self) -> None:
        if self.nic is not None:
            self.nic.close()
        if self.target is not None:
            self.target.close()
        self.loop.close()


def make_bench(name: str, nbytes: int, src: int) -> MemcpyBench | NicBench:
    if name == "memcpy":
        return MemcpyBench(nbytes, src)
    if name == "simnic":
        return NicBench("simnic", nbytes, src, {})
    if name in TCP_MODES:
        return NicBench("tcp", nbytes, src, {"host": "127.0.0.1", **TCP_MODES[name]})
    return NicBench("mooncake", nbytes, src, {"protocol": "tcp", "hostname": "127.0.0.1"},
                    symmetric=True)


def fill_weights(mapping: Any, start: int, nbytes: int, block: int = 16 << 20) -> None:
    """Fill the source with bf16 weights: a block of N(0, 0.02) values, repeated."""
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(0)
    pattern = (torch.randn(block // 2, generator=gen) * 0.02).to(torch.bfloat16)
    raw = pattern.view(torch.uint8).numpy()
    view = np.frombuffer(mapping, dtype=np.uint8)
    for off in range(start, start + nbytes, block):
        n = min(block, start + nbytes - off)
        view[off:off + n] = raw[:n]
    del view  # release the export: the mapping is closed later


def window_cost_us(updates: int = 2000) -> float:
    """Microseconds the tcp update window costs per update (an open and a close)."""
    nic = make_transport("tcp", owner="bench-window", nic="w", host="127.0.0.1")
    try:
        start = time.perf_counter()
        for _ in range(updates):
            nic.open_window()
            nic.close_window()
        return (time.perf_counter() - start) / updates * 1e6
    finally:
        nic.close()


def measure(names: list[str], sizes: list[int], repeats: int, src: int, progress: Progress,
            ) -> tuple[dict[str, Results], dict[str, str]]:
    """Best seconds per size for every backend that works, interleaved so that load
    on a shared machine hits all backends alike; and why the others did not run."""
    results: dict[str, Results] = {name: {} for name in names}
    unavailable: dict[str, str] = {}
    benches: dict[str, MemcpyBench | NicBench] = {}
    try:
        for name in names:
            try:
                benches[name] = make_bench(name, max(sizes), src)
            except Exception as e:
                unavailable[name] = f"unavailable: {type(e).__name__}: {e}"
        task = progress.add_task("measuring", total=len(sizes) * repeats)
        for size in sizes:
            progress.update(task, description=f"{format_size(size):>8}")
            best = dict.fromkeys(benches, float("inf"))
            for _ in range(repeats):
                for name, bench in list(benches.items()):
                    try:
                        best[name] = min(best[name], bench.once(size))
                    except Exception as e:
                        unavailable[name] = f"failed at {format_size(size)}: {e}"
                        benches.pop(name).close()
                progress.advance(task)
            for name in benches:
                results[name][size] = size / best[name] / 1e9
    finally:
        for bench in benches.values():
            bench.close()
    return results, unavailable


def render(results: dict[str, Results], unavailable: dict[str, str], sizes: list[int]) -> Table:
    table = Table(title="Transport throughput, GB/s (best of repeats)")
    table.add_column("size", justify="right")
    for name in results:
        table.add_column(name, justify="right")
    if "memcpy" in results and "simnic" in results:
        table.add_column("simnic / memcpy", justify="right")
    for size in sizes:
        row = [format_size(size)]
        for name, res in results.items():
            row.append(f"{res[size]:.2f}" if size in res else unavailable.get(name, "-")[:24])
        if "memcpy" in results and "simnic" in results:
            mem, sim = results["memcpy"].get(size), results["simnic"].get(size)
            row.append(f"{100 * sim / mem:.0f}%" if mem and sim else "-")
        table.add_row(*row)
    return table


def run(sizes: str = "1M,4M,16M,64M,256M,1G", repeats: int = 5,
        backends: str = ",".join(BACKENDS), json_path: Path | None = None) -> int:
    """Measure, print a table, optionally write JSON; returns the exit status."""
    console = command_console(json_path)
    try:
        size_list, names = sorted(set(parse_sizes(sizes))), parse_backends(backends)
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, not {repeats}")
    except ValueError as e:
        console.print(f"[red]bench transport: {e}")
        return 2
    mapping, offset, src = alloc_buffer(max(size_list), fill=0x5A)
    fill_weights(mapping, offset, max(size_list))
    try:
        with progress_bar(console, quiet=json_to_stdout(json_path)) as progress:
            results, unavailable = measure(names, size_list, repeats, src, progress)
    finally:
        mapping.close()
    console.print(render(results, unavailable, size_list))
    window_us = window_cost_us() if any(n in TCP_MODES for n in names) else None
    if window_us is not None:
        console.print(f"tcp update window: {window_us:.1f} us per update (open + close)")
    for name, why in unavailable.items():
        console.print(f"[yellow]{name}: {why}")
    if json_path is not None:
        doc: dict[str, Any] = {n: {str(s): v for s, v in r.items()} for n, r in results.items()}
        doc["unavailable"] = unavailable
        if window_us is not None:
            doc["tcp_window_us_per_update"] = window_us
        emit_json(json_path, doc, console)
    return 1 if any(name in unavailable for name in REQUIRED) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M,256M,1G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--json", type=Path, default=None, dest="json_path")
    args = parser.parse_args(argv)
    return run(sizes=args.sizes, repeats=args.repeats, backends=args.backends,
               json_path=args.json_path)


if __name__ == "__main__":
    raise SystemExit(main())
