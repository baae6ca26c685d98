"""``wt topology``: read GPUs and RDMA NICs from sysfs, write the cluster YAML.

The logic is in :mod:`scheduling.cluster.topology`; this module prints the pairing
as a table and writes the files. Exit codes: 0 written, 3 this host has no
NVIDIA GPU or no RDMA device (the message says which and where it looked;
nothing is written), 1 the sysfs tree or the options are inconsistent::

    wt topology                                  # YAML of this host to stdout
    wt topology --trainer-nodes 32 --replicas 8 --gpus-per-replica 16 --out cluster.yaml
    wt topology --sysfs /tmp/sysfs-copy --json topo.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from scheduling.cluster.topology import (
    HostTopology,
    NoHardwareError,
    cluster_dict,
    cluster_yaml,
    host_dict,
    read_host,
)

EXIT_NO_HARDWARE = 3
console = Console(stderr=True)


def _table(host: HostTopology) -> Table:
    table = Table(title=f"{len(host.gpus)} GPUs, {len(host.nics)} RDMA NICs")
    for col in ("GPU", "PCI", "NUMA", "NIC", "NIC PCI", "NIC NUMA", "rate", "nearest by"):
        table.add_column(col)
    for p in host.pairs:
        g, n = host.gpus[p.gpu].pci, host.nics[p.nic]
        rate = f"{n.gbps:g} Gb/s" if n.gbps is not None else "?"
        table.add_row(str(p.gpu), g.addr, str(g.numa), f"{p.nic} {n.name}", n.pci.addr,
                      str(n.pci.numa), rate, p.via)
    return table


def run(*, sysfs: Path, out: Path | None, json_path: Path | None, name: str,
        trainer_nodes: int, replicas: int, gpus_per_replica: int | None,
        trainer_expert_parallel: int, inference_expert_parallel: int, fp8: bool,
        nic_gbps: float | None) -> int:
    try:
        host = read_host(sysfs)
    except NoHardwareError as exc:
        console.print(f"[bold]wt topology[/]: nothing to describe: {exc}")
        return EXIT_NO_HARDWARE
    console.print(_table(host))
    try:
        data = cluster_dict(host, name=name, trainer_nodes=trainer_nodes, replicas=replicas,
                            gpus_per_replica=gpus_per_replica,
                            trainer_expert_parallel=trainer_expert_parallel,
                            inference_expert_parallel=inference_expert_parallel, fp8=fp8,
                            nic_gbps=nic_gbps)
        text = cluster_yaml(host, data, source=str(sysfs))
    except ValueError as exc:
        console.print(f"[bold red]wt topology[/]: {exc}")
        return 1
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        console.print(f"cluster config written to {out}")
    if json_path is not None:
        json_path.write_text(json.dumps({**host_dict(host), "cluster": data}, indent=2))
    return 0
