"""The output of ``wt bench designs``: which of ours binds, the table and the PNG chart.

Pure functions of the results document that :mod:`actors.tools.bench.designs.bench` builds
(one per engine; the chart's title names the engine when it is not ours)::

    console.print(table_of(results, total_bytes, rate, bound_s, title))
    draw_png(doc, Path("designs.png"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from actors.engine_registry import DEFAULT_ENGINE


def p2p_binding(r: dict[str, Any]) -> dict[str, Any] | None:
    """Which of ours binds, from its slowest rank's busy seconds: the link (``write``) or
    the CPU path (``prepare``: gathers, cuts and casts on this host's cores)."""
    stages = r.get("stages_s")
    if not stages:
        return None
    write, prepare = stages.get("write", 0.0), stages.get("prepare", 0.0)
    what = "link" if write >= prepare else "cpu"
    return {"binding": what, "write_busy_s": write, "prepare_busy_s": prepare,
            "line": f"ours: write busy {write:.3f} s, prepare busy {prepare:.3f} s "
                    f"(slowest rank, last update) -> the {what} binds"}


def table_of(results: dict, total: int, rate: float, bound_s: float, title: str) -> Table:
    table = Table(title=title)
    for col in ("design", "median s", "GB/s", "x ours", "own NIC bound s", "verified"):
        table.add_column(col, justify="right")
    ours = results.get("p2p", {}).get("median_s")
    for design, r in results.items():
        if "median_s" not in r:
            table.add_row(design, "-", "-", "-", "-", f"[red]no[/] ({r.get('error', '')[:60]})")
            continue
        ratio = f"{r['median_s'] / ours:.2f}" if ours else "-"
        table.add_row(design, f"{r['median_s']:.3f}", f"{total / r['median_s'] / 1e9:.3f}",
                      ratio, f"{r['busiest_nic_bytes'] / rate:.3f}",
                      "yes" if r["ok"] else "[red]FAILED[/]")
    table.caption = f"lower bound {bound_s:.3f} s"
    return table


def draw_png(doc: dict, path: Path) -> None:
    from actors.tools.cli.plots import import_pyplot

    plt = import_pyplot()
    passes = [k for k in ("caps_on", "caps_off") if k in doc["passes"]]
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4), squeeze=False)
    for ax, key in zip(axes[0], passes, strict=True):
        p = doc["passes"][key]
        names = [d for d, r in p["results"].items() if "median_s" in r]
        ax.bar(names, [p["results"][d]["median_s"] for d in names],
               color=["tab:green" if d == "p2p" else "tab:gray" for d in names])
        ax.axhline(p["lower_bound_s"], color="tab:red", ls="--", label="lower bound")
        if "gather_only_s" in p:
            ax.axhline(p["gather_only_s"], color="tab:blue", ls=":",
                       label="gather only (shared by all)")
        ax.set_ylabel("median seconds per update")
        engine = doc.get("engine", DEFAULT_ENGINE)
        where = "" if engine == DEFAULT_ENGINE else f" ({engine} engine)"
        ax.set_title(f"{doc['model']}{where}: {key.replace('_', ' ')}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
