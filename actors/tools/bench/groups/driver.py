"""The driver of ``wt bench groups``: runs in the head's namespace, prints one JSON line.

One fleet (``configs/clusters/netns_groups.yaml``: 2 trainer ranks -> 4 replicas x
TP1, the engines on Ray nodes of two remote sites) and two controllers over the
same actors, one after the other:

- ``direct``: the plan writes every replica from the trainers, so each site's slow
  link carries one copy per replica;
- ``grouped``: ``replica_groups`` are the replicas of each Ray node (site), so each
  link carries one copy per group, and the other replicas of the site are filled
  by a peer copy inside it (:mod:`actors.replica_groups`).

Per update: one train step, ``update(v)`` timed by its report, the bytes each
site's link received (its interface counters, read with ``ip -n`` from here), the
peer-copy bytes, and every engine byte of every replica checked against the
reference layout of the trainers' weights (digests computed in the actors). The
controllers' barrier store host is reported too (the head's site address)::

    ip netns exec NS python -m actors.tools.bench.groups.driver --links site0=NS0,site1=NS1
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import ray

from actors import WeightTransferController
from actors.tools.demo.fleet import check_bytes, connect_ray, start_fleet, token_batch
from actors.tools.demo.run_config import RunConfig, load_run_config, parse_run_config
from actors.tools.demo.verify import first_answer
from actors.tools.testkit.netns import link_counters

log = logging.getLogger(__name__)

CLUSTER = "configs/clusters/netns_groups.yaml"
MODES = ("direct", "grouped")
RUNS = {"tcp": "configs/runs/demo_tcp.yaml", "mooncake": "configs/runs/demo_mooncake.yaml"}


def site_groups(replicas: dict[str, list[Any]]) -> list[list[str]]:
    """The replicas of each Ray node (a site), in replica order: the replica groups."""
    nodes = {name: ray.get(actors[0].node_id.remote()) for name, actors in replicas.items()}
    groups: dict[str, list[str]] = {}
    for name, node in nodes.items():
        groups.setdefault(node, []).append(name)
    return list(groups.values())


def one_update(fleet: Any, ctl: Any, version: int, links: dict[str, str]) -> dict[str, Any]:
    """Train, update, verify; the row of this update."""
    cfg = fleet.config.model
    batch = token_batch(cfg.vocab_size, 4, 16, seed=1000 + version)
    first_answer(ray.get([t.train_step.remote(batch) for t in fleet.trainers]))
    before = {site: link_counters(ns)["in"] for site, ns in links.items()}
    report = ctl.update(version)
    link_in = {site: link_counters(ns)["in"] - before[site] for site, ns in links.items()}
    checks: dict[str, Any] = {}
    problems: list[str] = []
    check_bytes(fleet, checks, problems, None)
    versions = ctl.weights_version()
    if any(v != version for v in versions.values()):
        problems.append(f"replica versions after update {version}: {versions}")
    return {"version": version, "seconds": report.seconds, "trainer_bytes": report.bytes,
            "peer_bytes": sum(ctl.group_copies.values()), "link_in": link_in,
            "verified": not problems, "problems": problems[:5]}


def run_mode(fleet: Any, mode: str, groups: list[list[str]], *, updates: int, first: int,
             links: dict[str, str]) -> dict[str, Any]:
    """``updates`` updates of one mode on the fleet's actors (a controller of its own)."""
    config = fleet.config.replace(replica_groups=groups if mode == "grouped" else ())
    ctl = WeightTransferController(trainers=fleet.trainers,
                                   engines=list(fleet.replicas.values()), config=config)
    try:
        summary = ctl.setup()
        rows = [one_update(fleet, ctl, first + i, links) for i in range(updates)]
        store = ctl.state.store_host
    finally:
        ctl.shutdown()
    return {"mode": mode, "plan_bytes": summary.bytes_total, "store_host": store,
            "groups": groups if mode == "grouped" else [], "updates": rows}


def run_config(transport: str, updates: int) -> RunConfig:
    """The demo's run config of ``transport`` on :data:`CLUSTER`; ``mooncake`` TCP with
    ``allow_unauthenticated`` (it crosses hosts here: namespaces nobody else reaches)."""
    if transport not in RUNS:
        raise ValueError(f"groups bench: transport {transport!r} is not one of {sorted(RUNS)}")
    data = load_run_config(RUNS[transport]).model_dump(by_alias=True)
    if transport == "mooncake":
        data["transfer"]["transport_options"]["allow_unauthenticated"] = True
    return parse_run_config(data, source=RUNS[transport]).with_overrides(
        cluster=CLUSTER, updates=updates)


def run(*, links: dict[str, str], updates: int, transport: str) -> dict[str, Any]:
    run_cfg = run_config(transport, updates)
    started = connect_ray(run_cfg)
    fleet = None
    try:
        fleet = start_fleet(run_cfg)
        fleet.controller.shutdown()  # the fleet's own controller: each mode makes its own
        groups = site_groups(fleet.replicas)
        results = [run_mode(fleet, mode, groups, updates=updates, first=1 + i * updates,
                            links=links) for i, mode in enumerate(MODES)]
        return {"transport": transport, "replicas": list(fleet.replicas),
                "replica_bytes": results[0]["plan_bytes"] // len(fleet.replicas),
                "driver_ip": ray.util.get_node_ip_address(), "modes": results}
    finally:
        if fleet is not None:
            fleet.close()
        if started:
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", required=True,
                        help="site=namespace,... whose link (wt0) counters to read")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--transport", default="tcp")
    args = parser.parse_args(argv)
    links = dict(item.split("=", 1) for item in args.links.split(","))
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    out = run(links=links, updates=args.updates, transport=args.transport)
    out["seconds"] = time.perf_counter() - start
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    return 0 if all(u["verified"] for m in out["modes"] for u in m["updates"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
