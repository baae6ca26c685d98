"""Run the demo job from a run config: the entry point for ``ray job submit``.

On a cluster started with ``ray start --head`` (any machine that can reach it)::

    ray job submit --working-dir . -- python scripts/launch.py --config configs/runs/demo.yaml

The job joins the cluster it runs in (``RAY_ADDRESS``, which Ray sets for a
submitted job, or an address in the run config); started by hand outside any
cluster it joins a running local one when there is one and otherwise starts a
local instance. It runs exactly what ``wt demo`` runs (:func:`actors.tools.demo.fleet.run_job`),
prints the same table, and exits non-zero when any update fails verification,
so the job's status is SUCCEEDED only for a verified run. Options override the
run config: ``--updates N``, ``--fp8/--no-fp8``, ``--json PATH``, ``--transport
simnic|mooncake|rdma`` (simnic reaches only actors on one host; setup says so).
"""

from __future__ import annotations

from pathlib import Path

import typer

from actors.tools.demo.checks import make_console
from actors.tools.demo.run_config import load_run_config

console = make_console()


def main(
    config: Path = typer.Option(..., help="Run config (configs/runs/*.yaml)."),
    updates: int | None = typer.Option(None, min=1, help="Train-step + update cycles."),
    fp8: bool | None = typer.Option(None, "--fp8/--no-fp8", help="FP8 engines."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the report as JSON."),
    transport: str | None = typer.Option(None, help="simnic, mooncake or rdma."),
) -> None:
    """Run the demo job of a run config on the current Ray cluster (or a local one)."""
    try:
        run = load_run_config(config).with_overrides(updates=updates, fp8=fp8,
                                                     json_path=json_path, transport=transport)
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    from actors.tools.demo.fleet import run_job

    raise typer.Exit(run_job(run, join_existing=True, console=console))


if __name__ == "__main__":
    typer.run(main)
