"""``wt soak``: many consecutive updates on the demo cluster; nothing may grow.

After a few warm-up updates (first-use allocations: staging buffers, thread
pools) every process is measured (resident memory, open file descriptors,
threads) together with the number of keys in every store: the controller's
barrier store and each process group's TCPStore (hosted by the group's rank 0).
Then ``--updates`` more updates run back to back (no train step: the same
weights each time, so any growth is the transfer's own), every process is
measured again (and half way, ``mid`` in the JSON: growth that stops is
warm-up, growth that goes on is a leak), and the last update is verified byte
for byte::

    wt soak --updates 200                # a table: start, end, growth per process
    wt soak --updates 20 --json soak.json

Tolerances (:data:`TOLERANCE`): resident memory may grow by at most
``max(rss_abs_bytes, rss_rel * start)``, open file descriptors and threads by
``fds`` and ``threads`` (Ray's own worker threads come and go), and those two only
count while they still grow in the second half (a connection opened once, late, is
warm-up; a leak goes on); a simnic writer's handles on its peers' region tables are
counted apart, each pool at most the NIC's ``max_inflight``; store keys not at all. A
row that grew names the kinds of descriptor (socket, pipe, a file's directory) that
changed. The exit code is 1 when
anything grows beyond them or the last update does not verify.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
from rich.console import Console
from rich.table import Table

from actors.tools.cli.progress import command_console, emit_json, json_to_stdout, progress_bar
from actors.tools.demo.fleet import Fleet, fleet_session
from actors.tools.demo.run_config import load_run_config
from actors.tools.demo.verify import check_bytes
from weight_transfer.types import EngineRankId

TOLERANCE: dict[str, float] = {"rss_abs_bytes": 32 << 20, "rss_rel": 0.05, "fds": 2,
                               "threads": 4, "store_keys": 0}
TABLE_HANDLES = "/memfd:simnic-"  # the kind of a simnic region table's descriptor
# A trainer rank started moments before (a replaced rank) opens a few descriptors over its
# first ~10 updates and then none (measured: 2-4 fds, the clean-clone runs' only soak failure)
WARMUP_UPDATES = 12


def _fd_kind(fd: str) -> str:
    """What a descriptor is: ``socket``, ``pipe``, ``anon_inode:[eventfd]``, or the file's
    directory (``/dev/shm``); ``gone`` when it closed while listed."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "gone"
    if target.startswith("/"):
        return os.path.dirname(target) or "/"
    return target.split(":[", 1)[0] if target.startswith(("socket:", "pipe:")) else target


def process_stats() -> dict[str, Any]:
    """This process: resident bytes, open file descriptors (and how many of each kind),
    threads (from /proc)."""
    fields = dict(line.split(":", 1) for line in
                  Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        kind = _fd_kind(fd)
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
            "fds": sum(kinds.values()), "threads": int(fields["Threads"]), "fd_kinds": kinds}


def _actor_stats(actor: Any) -> dict[str, int]:
    """Inside an actor (``__ray_call__``): its process, and its group's store on rank 0."""
    stats = process_stats()
    bound = getattr(getattr(actor, "_wt_nic", None), "max_inflight", None)
    if isinstance(bound, int):  # a simnic writer: its pools of peers' table handles
        stats["table_handle_bound"] = bound
    store = getattr(actor, "_store", None)
    if store is not None and getattr(actor, "rank", getattr(actor, "local", None)) == 0:
        stats["store_keys"] = store.num_keys()
    return stats


def measure(fleet: Fleet) -> dict[str, dict[str, int]]:
    """``{process label: stats}`` of every trainer, engine rank, the scheduler, the driver."""
    ctl = fleet.controller
    actors = {f"trainer{r}": t for r, t in enumerate(ctl.trainers)}
    actors |= {str(EngineRankId(replica=n, rank=r)): a for n, ranks in ctl.replicas.items()
               for r, a in enumerate(ranks)}
    refs = {label: a.__ray_call__.remote(_actor_stats) for label, a in actors.items()}
    out = {label: ray.get(ref, timeout=60) for label, ref in refs.items()}
    out["scheduler"] = ray.get(ctl.scheduler.__ray_call__.remote(
        lambda self: process_stats()), timeout=60)
    out["controller"] = process_stats() | {"store_keys": ctl.state.store.num_keys()}
    return out


def growth(start: dict[str, Any], end: dict[str, Any],
           mid: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """(end - start per field, the fields beyond :data:`TOLERANCE`). With ``mid`` (the half
    way measurement), descriptors and threads count as grown only while they still grow in
    the second half: a few opened once (a lazily made connection) is warm-up, a leak goes on.
    ``diff["fd_kinds"]`` names the kinds of descriptor that changed."""
    diff: dict[str, Any] = {k: end[k] - start[k] for k in start
                            if k in end and isinstance(start[k], int)}
    s_kinds, e_kinds = start.get("fd_kinds", {}), end.get("fd_kinds", {})
    diff["fd_kinds"] = {k: e_kinds.get(k, 0) - s_kinds.get(k, 0) for k in s_kinds | e_kinds
                        if e_kinds.get(k, 0) != s_kinds.get(k, 0)}
    rss_cap = max(TOLERANCE["rss_abs_bytes"], TOLERANCE["rss_rel"] * start["rss_bytes"])
    over = ["rss_bytes"] if diff["rss_bytes"] > rss_cap else []
    # a simnic writer keeps one handle on a peer's region table per write in flight to it
    # (OFD locks are per open): a pool that fills up to max_inflight the first times that
    # many writes overlap, late under load. Counted apart: bounded, not a leak, unless a
    # pool grows past the bound.
    bound, pooled = start.get("table_handle_bound"), 0
    if bound is not None:
        pools = {k: n for k, n in diff["fd_kinds"].items() if k.startswith(TABLE_HANDLES)}
        pooled = sum(pools.values())
        if any(n > 0 and e_kinds[k] > bound for k, n in pools.items()):
            over.append("table handles")
    for k in ("fds", "threads", "store_keys"):
        still = k == "store_keys" or mid is None or end.get(k, 0) > mid.get(k, 0)
        grew = diff.get(k, 0) - (pooled if k == "fds" else 0)
        if grew > TOLERANCE[k] and still:
            over.append(k)
    return diff, over


def _over_text(row: dict[str, Any]) -> str:
    """``fds (socket +3)``: what grew, and for descriptors which kinds."""
    kinds = " ".join(f"{k} {n:+d}" for k, n in sorted(row["growth"].get("fd_kinds", {}).items()))
    return ", ".join(f"{k} ({kinds})" if k == "fds" and kinds else k for k in row["over"])


def render(doc: dict[str, Any]) -> Table:
    table = Table(title=f"wt soak: {doc['updates']} updates in {doc['seconds']:.1f} s")
    for col in ("process", "RSS MiB start", "end", "fds start", "end", "threads start", "end",
                "store keys start", "end", "ok"):
        table.add_column(col, justify="right" if col != "process" else "left")
    for label, row in doc["actors"].items():
        s, e = row["start"], row["end"]
        table.add_row(label, f"{s['rss_bytes'] / 2**20:.1f}", f"{e['rss_bytes'] / 2**20:.1f}",
                      str(s["fds"]), str(e["fds"]), str(s["threads"]), str(e["threads"]),
                      str(s.get("store_keys", "-")), str(e.get("store_keys", "-")),
                      "[green]yes[/]" if row["ok"] else f"[red]{_over_text(row)}[/]")
    return table


def soak(fleet: Fleet, updates: int, console: Console, *, first_version: int = 1) -> dict:
    """Warm up, measure, ``updates`` updates, measure, verify; the JSON document."""
    ctl, version = fleet.controller, first_version
    for _ in range(WARMUP_UPDATES):
        ctl.update(version)
        version += 1
    start_stats, start = measure(fleet), time.perf_counter()
    mid_stats = None
    with progress_bar(console) as bar:
        task = bar.add_task("updates", total=updates)
        for i in range(updates):
            if i == updates // 2:
                mid_stats = measure(fleet)
            ctl.update(version)
            version += 1
            bar.advance(task)
    seconds = time.perf_counter() - start
    end_stats = measure(fleet)
    problems: list[str] = []
    fleet.replicas = {n: ctl.replicas[n] for n in sorted(ctl.replicas)}
    check_bytes(fleet, {}, problems, None)
    actors = {}
    for label, s in start_stats.items():
        diff, over = growth(s, end_stats[label], mid_stats[label])
        actors[label] = {"start": s, "mid": mid_stats[label], "end": end_stats[label],
                         "growth": diff, "over": over, "ok": not over}
    return {"updates": updates, "warmup_updates": WARMUP_UPDATES, "seconds": seconds,
            "last_version": version - 1, "tolerance": TOLERANCE, "actors": actors,
            "verified": not problems, "problems": problems,
            "ok": not problems and all(a["ok"] for a in actors.values())}


def run(*, config: Path, updates: int, json_path: Path | None,
        fleet: Fleet | None = None, first_version: int = 1) -> int:
    """``wt soak``; ``fleet``: soak these actors (tests) instead of starting the demo's."""
    console = command_console(json_path)
    run_cfg = load_run_config(config)
    with fleet_session(run_cfg, fleet) as active:
        doc = soak(active, updates, console, first_version=first_version)
    console.print(render(doc))
    for p in doc["problems"]:
        console.print(f"  [red]{p}[/]")
    if json_path is not None:
        emit_json(str(json_path) if json_to_stdout(json_path) else json_path, doc, console)
    console.print("[green]nothing grew beyond the tolerance; the last update verified[/]"
                  if doc["ok"] else "[bold red]growth beyond the tolerance or a failed check[/]")
    return 0 if doc["ok"] else 1
