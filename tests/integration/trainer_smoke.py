"""``wt demo --trainer NAME`` and ``wt bench designs --trainer NAME`` as smoke runs on one
fleet of the demo's smallest shape: the trainer modules' (DeepSpeed, Megatron) shared check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def demo_and_bench(trainer: str, run_path: Path, tmp_path: Path) -> dict[str, Any]:
    """The demo (2 updates, each verified: bytes and generations) then the designs bench
    (``p2p`` beside ``native``, NIC caps on and off, every design verified) on one fleet of
    ``trainer`` ranks; the bench's JSON, after checking what both runs say of themselves."""
    from rich.console import Console

    from actors.tools.bench.designs.bench import run as bench_designs
    from actors.tools.demo.fleet import run_cycles, start_fleet
    from actors.tools.demo.run_config import load_run_config

    run = load_run_config(run_path).with_overrides(trainer=trainer, updates=2)
    fleet = start_fleet(run)
    try:
        assert fleet.info()["trainer"] == trainer  # what --json adds
        rows = run_cycles(fleet, Console(quiet=True))
        assert [r.verified for r in rows] == [True, True], [r.problems for r in rows]
        assert all(r.checks["bytes"] and r.checks["generations"] for r in rows)
        out = tmp_path / "designs.json"
        assert bench_designs(config=run_path, model=None, nic_gbps=0.05, updates=1,
                             designs=None, bucket="1M", caps_off=True, timeout_s=300.0,
                             json_path=out, png=None, fleet=fleet) == 0
    finally:
        fleet.close()
    doc = json.loads(out.read_text())
    assert doc["trainer"] == trainer and set(doc["results"]) == {"p2p", "native"}
    for key in ("caps_on", "caps_off"):
        results = doc["passes"][key]["results"]
        assert set(results) == {"p2p", "native"}
        assert all(r["ok"] and r["problems"] == [] for r in results.values()), results
    return doc
