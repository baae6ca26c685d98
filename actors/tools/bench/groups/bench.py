"""``wt bench groups``: replica groups across a slow link, against a copy per replica over it.

Three network namespaces (:mod:`actors.tools.testkit.netns`): ``trainers`` (the Ray head,
the driver and the trainer ranks) and two remote sites, ``site0`` and ``site1``,
each holding two replicas (Ray nodes of their own, :mod:`actors.tools.testkit.netns_ray`)
behind a link shaped with ``tc tbf`` to ``rate_mbit`` both ways. The driver
(:mod:`actors.tools.bench.groups.driver`) runs the same updates twice on one fleet:
``direct`` (the trainers write every replica, two copies over each link) and
``grouped`` (one copy per site over its link, the second replica filled from the
first inside the site). The table puts side by side, per mode: seconds per
update, bytes each link received, bytes copied between peers, the lower bound the
rate sets (link bytes / rate), and whether every engine byte was verified::

    sudo wt bench groups --rate-mbit 40 --updates 2 --json out.json

Needs root (namespaces, veths, tc); exits 2 with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.table import Table

from actors.tools.cli.progress import command_console, emit_json
from actors.tools.testkit.netns import NetnsNetwork, Shaping, netns_unavailable
from actors.tools.testkit.netns_ray import NetnsRay

SITES = ("trainers", "site0", "site1")
# Configured trainer nodes on the trainers' site; replicas 0-1 on site0, 2-3 on site1.
RESOURCES = {"trainers": {"node_0": 8, "node_1": 8},
             "site0": {"inode_0": 8, "inode_1": 8},
             "site1": {"inode_2": 8, "inode_3": 8}}


@contextlib.contextmanager
def sites_cluster() -> Iterator[tuple[NetnsNetwork, NetnsRay]]:
    """The three sites and their Ray nodes; everything removed after the block."""
    with NetnsNetwork(list(SITES)) as net, NetnsRay(net, head="trainers",
                                                     resources=RESOURCES) as cluster:
        yield net, cluster


def run_groups_driver(net: NetnsNetwork, cluster: NetnsRay, *, updates: int,
                      transport: str = "tcp", timeout: float = 900.0) -> dict[str, Any]:
    """Run :mod:`actors.tools.bench.groups.driver` in the head's site; its JSON (RuntimeError
    with its output when it printed none)."""
    links = ",".join(f"{s}={net.site(s).ns}" for s in SITES[1:])
    out = cluster.run_driver([sys.executable, "-m", "actors.tools.bench.groups.driver",
                              "--links", links, "--updates", str(updates),
                              "--transport", transport], timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"groups driver exited {out.returncode} without a result: "
                           f"{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def mode_rows(result: dict[str, Any], rate: Shaping) -> list[dict[str, Any]]:
    """One summary per mode: mean seconds, bytes over each slow link per update, the rate's
    bound, peer bytes, verified."""
    rows = []
    for mode in result["modes"]:
        ups = mode["updates"]
        link = {s: sum(u["link_in"][s] for u in ups) / len(ups) for s in SITES[1:]}
        rows.append({
            "mode": mode["mode"], "seconds": sum(u["seconds"] for u in ups) / len(ups),
            "best_seconds": min(u["seconds"] for u in ups),
            "trainer_bytes": ups[0]["trainer_bytes"], "peer_bytes": ups[0]["peer_bytes"],
            "link_bytes": link, "bound_seconds": max(link.values()) / rate.bytes_per_s,
            "verified": all(u["verified"] for u in ups)})
    return rows


def render(rows: list[dict[str, Any]], rate: Shaping) -> Table:
    table = Table(title=f"replica groups over links shaped to {rate.rate_mbit:g} Mbit/s "
                        f"(tc tbf), 2 sites x 2 replicas")
    for col in ("mode", "s/update", "best s", "MB over site0 link", "MB over site1 link",
                "MB from trainers", "MB peer copy", "rate bound s", "verified"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        table.add_row(r["mode"], f"{r['seconds']:.2f}", f"{r['best_seconds']:.2f}",
                      f"{r['link_bytes']['site0'] / 1e6:.2f}",
                      f"{r['link_bytes']['site1'] / 1e6:.2f}",
                      f"{r['trainer_bytes'] / 1e6:.2f}", f"{r['peer_bytes'] / 1e6:.2f}",
                      f"{r['bound_seconds']:.2f}", "yes" if r["verified"] else "NO")
    return table


def run(*, rate_mbit: float, updates: int, transport: str, json_path: Path | None) -> int:
    console = command_console(json_path)
    if (why := netns_unavailable()) is not None:
        console.print(f"[bold red]error:[/] wt bench groups: {why}")
        return 2
    rate = Shaping(rate_mbit=rate_mbit)
    with sites_cluster() as (net, cluster):
        for site in SITES[1:]:
            net.shape(site, rate)
        result = run_groups_driver(net, cluster, updates=updates, transport=transport)
    rows = mode_rows(result, rate)
    console.print(render(rows, rate))
    direct, grouped = rows
    slowest = {r["mode"]: max(r["link_bytes"].values()) for r in rows}
    console.print(f"grouped / direct: {grouped['seconds'] / direct['seconds']:.2f}x the time, "
                  f"{slowest['grouped'] / slowest['direct']:.2f}x the bytes over a slow link")
    if json_path is not None:
        emit_json(json_path, {"rate_mbit": rate_mbit, "rows": rows, "raw": result}, console)
    return 0 if all(r["verified"] for r in rows) else 1
