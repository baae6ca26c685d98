"""Transport benchmark: GB/s of memcpy, simnic and Mooncake TCP, side by side.

Run ``wt bench transport`` or, directly,
``python scripts/bench_transport.py --sizes 1M,64M,1G --repeats 5 --json out.json``.
For every size it reports the best of ``repeats`` timed copies of that size:

* ``memcpy``: ``ctypes.memmove`` between two pre-faulted buffers of this process,
  on one thread: the ceiling of a one-copy transfer on this machine;
* ``simnic``: an uncapped SimNic WRITE from a pre-faulted buffer here into a
  pre-faulted, registered region of ANOTHER process (a
  :class:`~weight_transfer.transport.harness.RemoteTarget` child);
* ``mooncake_tcp``: Mooncake's TransferEngine over TCP on loopback into a
  RemoteTarget child, when the ``mooncake`` extra is installed and works;

and simnic as a percentage of memcpy (the target: >= 90% from 64 MiB up).
``--json PATH`` writes ``{"memcpy": {size: GBps}, "simnic": {...},
"mooncake_tcp": {...}, "unavailable": {backend: reason}}`` with sizes as string
keys; a backend that could not run has an empty table and a reason.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from scripts.sizes import format_size, parse_sizes
from weight_transfer.transport import make_transport
from weight_transfer.transport._vm import alloc_buffer
from weight_transfer.transport.harness import RemoteTarget

BACKENDS = ("memcpy", "simnic", "mooncake_tcp")
REQUIRED = ("memcpy", "simnic")  # an optional backend that fails is reported, not fatal
Tick = Callable[[], None]
Results = dict[int, float]


def parse_backends(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"backends: unknown {unknown or text!r}; choose from {list(BACKENDS)}")
    return names


def bench_memcpy(sizes: list[int], repeats: int, src: int, tick: Tick) -> Results:
    mapping, _, dst = alloc_buffer(max(sizes), fill=0)
    out = {}
    try:
        for size in sizes:
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                ctypes.memmove(dst, src, size)
                best = min(best, time.perf_counter() - start)
                tick()
            out[size] = size / best / 1e9
    finally:
        mapping.close()
    return out


async def _time_writes(nic: Any, target: RemoteTarget, sizes: list[int], repeats: int,
                       src: int, tick: Tick) -> Results:
    await nic.write((src, min(sizes)), target.region, 0)  # warm-up: threads, sessions
    out = {}
    for size in sizes:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            await nic.write((src, size), target.region, 0)
            best = min(best, time.perf_counter() - start)
            tick()
        out[size] = size / best / 1e9
    return out


def bench_simnic(sizes: list[int], repeats: int, src: int, tick: Tick) -> Results:
    with RemoteTarget("simnic", nbytes=max(sizes), guard_bytes=0, owner="bench-target",
                      transport_opts={"nic": "sim-t"}) as target:
        nic = make_transport("simnic", owner="bench-writer", nic="sim-w")
        try:
            nic.connect(target.peer_info)
            return asyncio.run(_time_writes(nic, target, sizes, repeats, src, tick))
        finally:
            nic.close()


def bench_mooncake_tcp(sizes: list[int], repeats: int, src: int, tick: Tick) -> Results:
    opts = {"protocol": "tcp", "hostname": "127.0.0.1"}
    nic = make_transport("mooncake", owner="bench-writer", nic="mc-w", **opts)
    try:
        with RemoteTarget("mooncake", nbytes=max(sizes), guard_bytes=0, owner="bench-target",
                          peer_owner="bench-writer",
                          transport_opts={"nic": "mc-t", **opts}) as target:
            nic.connect(target.peer_info)
            target.connect(nic.peer_info("bench-target"))
            return asyncio.run(_time_writes(nic, target, sizes, repeats, src, tick))
    finally:
        nic.close()


BENCHES = {"memcpy": bench_memcpy, "simnic": bench_simnic, "mooncake_tcp": bench_mooncake_tcp}


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
    console = Console()
    try:
        size_list, names = sorted(set(parse_sizes(sizes))), parse_backends(backends)
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, not {repeats}")
    except ValueError as e:
        console.print(f"[red]bench transport: {e}")
        return 2
    mapping, _, src = alloc_buffer(max(size_list), fill=0x5A)
    results: dict[str, Results] = {}
    unavailable: dict[str, str] = {}
    failed = False
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        for name in names:
            task = progress.add_task(name, total=len(size_list) * repeats)
            try:
                results[name] = BENCHES[name](size_list, repeats, src,
                                              lambda t=task: progress.advance(t))
            except Exception as e:
                logging.getLogger(__name__).debug("%s failed", name, exc_info=True)
                results[name] = {}
                unavailable[name] = f"unavailable: {type(e).__name__}: {e}"
                failed |= name in REQUIRED
    mapping.close()
    console.print(render(results, unavailable, size_list))
    for name, why in unavailable.items():
        console.print(f"[yellow]{name}: {why}")
    if json_path is not None:
        doc: dict[str, Any] = {n: {str(s): v for s, v in r.items()} for n, r in results.items()}
        doc["unavailable"] = unavailable
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {json_path}")
    return 1 if failed else 0


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
