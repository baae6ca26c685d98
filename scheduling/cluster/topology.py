"""The cluster described from the hardware: GPUs, RDMA NICs and which NIC each GPU uses.

Reads a sysfs tree (``/sys``, or a copy of one for tests) as the kernel
exposes it:

- GPUs: ``bus/pci/devices/*`` with ``vendor`` 0x10de (NVIDIA) and a display
  ``class`` (0x0300xx VGA or 0x0302xx 3D controller; NVSwitches are bridges,
  0x0680xx, and are skipped), in PCI address order (``nvidia-smi``'s order);
- RDMA NICs: ``class/infiniband/*``, each with its ``device`` link to its PCI
  function, the rate of port 1 (``ports/1/rate``, e.g. ``400 Gb/sec (4X NDR)``)
  and its link layer, in name order (``mlx5_0``, ``mlx5_1``, ...);
- for every device, its path in the PCI tree (the chain of bridges the
  ``devices/pci*`` link resolves to) and its ``numa_node``.

Each GPU is paired with its nearest NIC: the deepest common ancestor in the
PCI tree first (the same PCIe switch beats the same root port beats the same
host bridge), then the same NUMA node, then the NIC fewest GPUs use so far,
then the lower index. That is the rule by which production NIC-affinity
settings (``NCCL_IB_HCA``, ``UCX_NET_DEVICES`` per local rank) are chosen by
hand today::

    host = read_host(Path("/sys"))          # HostTopology; pure, no torch, no Ray
    host.gpu_nic                            # (0, 1, 2, ...) NIC index per GPU
    data = cluster_dict(host, name="h100x2", trainer_nodes=2, replicas=2)
    text = cluster_yaml(host, data)         # validated by scheduling.cluster.config, with comments

Every node is assumed to look like the one read (the cluster YAML describes
one kind of node). A host with no NVIDIA GPU or no RDMA device raises
:class:`NoHardwareError` that says which is missing and where it looked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from scheduling.cluster.config import ClusterConfig, cluster_from_dict
from weight_transfer.errors import WeightTransferError

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)  # VGA compatible, 3D controller (class >> 8)
_PCI_ADDR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_RATE = re.compile(r"^\s*([0-9.]+)\s*Gb/sec")


class NoHardwareError(WeightTransferError, RuntimeError):
    """The sysfs tree shows no NVIDIA GPU or no RDMA device."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PciDevice:
    """One PCI function: its address, the bridges above it, its NUMA node (-1: unknown)."""

    addr: str
    path: tuple[str, ...]  # PCI addresses from the host bridge's first port down to addr
    root: str  # the host bridge, e.g. "pci0000:15"
    numa: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    index: int
    pci: PciDevice


@dataclass(frozen=True, slots=True, kw_only=True)
class Nic:
    index: int
    name: str  # the RDMA device, e.g. "mlx5_0"
    pci: PciDevice
    gbps: float | None  # port 1 rate, None when sysfs does not say
    link_layer: str  # "InfiniBand", "Ethernet" (RoCE) or ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Pairing:
    """Why GPU ``gpu`` sends through NIC ``nic``."""

    gpu: int
    nic: int
    shared_depth: int  # PCI path components in common (0: different host bridges)
    same_numa: bool
    via: str  # "PCIe switch", "root port", "host bridge", "NUMA node" or "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostTopology:
    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]
    pairs: tuple[Pairing, ...]

    @property
    def gpu_nic(self) -> tuple[int, ...]:
        return tuple(p.nic for p in self.pairs)

    @property
    def nic_gbps(self) -> float | None:
        """The slowest port rate of the NICs in use (None when sysfs gave none)."""
        rates = [self.nics[i].gbps for i in set(self.gpu_nic)]
        return None if any(r is None for r in rates) else min(rates)


# --------------------------------------------------------------------------- reading sysfs


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def _int(text: str, default: int) -> int:
    try:
        return int(text, 0)
    except ValueError:
        return default


def pci_device(sysfs: Path, addr: str) -> PciDevice:
    """The PCI function ``addr`` with its chain of bridges, from its ``devices/pci*`` link."""
    link = sysfs / "bus" / "pci" / "devices" / addr
    real = Path(os.path.realpath(link))
    parts = real.parts
    roots = [i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p]
    if not roots:
        raise ValueError(f"{link} resolves to {real}, which is not under a devices/pci* root")
    root = roots[-1]
    path = tuple(p for p in parts[root + 1 :] if _PCI_ADDR.match(p))
    if not path or path[-1] != addr:
        raise ValueError(f"{link} resolves to {real}, which does not end in {addr}")
    numa = _int(_read(link / "numa_node", "-1"), -1)
    return PciDevice(addr=addr, path=path, root=parts[root], numa=numa)


def find_gpus(sysfs: Path) -> list[PciDevice]:
    """NVIDIA display-class PCI functions, in PCI address order."""
    devices = sysfs / "bus" / "pci" / "devices"
    if not devices.is_dir():
        return []
    out = []
    for entry in sorted(devices.iterdir(), key=lambda p: p.name):
        vendor = _int(_read(entry / "vendor"), -1)
        cls = _int(_read(entry / "class"), -1)
        if vendor == NVIDIA_VENDOR and cls >> 8 in GPU_CLASSES:
            out.append(pci_device(sysfs, entry.name))
    return out


def parse_rate(text: str) -> float | None:
    """Gb/s of a port ``rate`` file (``"400 Gb/sec (4X NDR)"`` -> 400.0)."""
    m = _RATE.match(text)
    return float(m.group(1)) if m else None


def find_nics(sysfs: Path) -> list[Nic]:
    """RDMA devices of ``class/infiniband``, in name order, with their PCI function."""
    ib = sysfs / "class" / "infiniband"
    if not ib.is_dir():
        return []
    out = []
    for entry in sorted(ib.iterdir(), key=lambda p: _natural(p.name)):
        dev = Path(os.path.realpath(entry / "device"))
        if not _PCI_ADDR.match(dev.name):
            continue  # a software device (rxe, siw) has no PCI function of its own
        port = entry / "ports" / "1"
        out.append(Nic(index=len(out), name=entry.name, pci=pci_device(sysfs, dev.name),
                       gbps=parse_rate(_read(port / "rate")),
                       link_layer=_read(port / "link_layer")))
    return out


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


# --------------------------------------------------------------------------- pairing, pure


def shared_depth(a: PciDevice, b: PciDevice) -> int:
    """How many PCI path components two devices share (0: different host bridges)."""
    if a.root != b.root:
        return 0
    n = 1  # the host bridge itself
    for x, y in zip(a.path, b.path, strict=False):
        if x != y:
            break
        n += 1
    return n


def _via(depth: int, same_numa: bool) -> str:
    if depth == 0:
        return "NUMA node" if same_numa else "none"
    below_root = depth - 1  # bridges shared below the host bridge
    if below_root == 0:
        return "host bridge"
    if below_root == 1:
        return "root port"
    return "PCIe switch"


def pair_gpus(gpus: Sequence[PciDevice], nics: Sequence[PciDevice]) -> list[Pairing]:
    """Each GPU's nearest NIC (see the module docstring for the order of the criteria)."""
    if not nics:
        raise ValueError("cannot pair GPUs with NICs: no NICs")
    load = [0] * len(nics)
    out = []
    for g, gpu in enumerate(gpus):
        def key(j: int, gpu: PciDevice = gpu) -> tuple:
            same = gpu.numa >= 0 and gpu.numa == nics[j].numa
            return (-shared_depth(gpu, nics[j]), not same, load[j], j)

        best = min(range(len(nics)), key=key)
        load[best] += 1
        depth = shared_depth(gpu, nics[best])
        same = gpu.numa >= 0 and gpu.numa == nics[best].numa
        out.append(Pairing(gpu=g, nic=best, shared_depth=depth, same_numa=same,
                           via=_via(depth, same)))
    return out


def read_host(sysfs: Path | str = "/sys") -> HostTopology:
    """GPUs, RDMA NICs and the pairing of this host; NoHardwareError if either is missing."""
    sysfs = Path(sysfs)
    gpus = find_gpus(sysfs)
    nics = find_nics(sysfs)
    missing = []
    if not gpus:
        missing.append(f"no NVIDIA GPU (vendor 0x10de, class 0x0300/0x0302) under "
                       f"{sysfs / 'bus/pci/devices'}")
    if not nics:
        missing.append(f"no RDMA device under {sysfs / 'class/infiniband'}")
    if missing:
        raise NoHardwareError("; ".join(missing))
    pairs = pair_gpus(gpus, [n.pci for n in nics])
    return HostTopology(gpus=tuple(Gpu(index=i, pci=p) for i, p in enumerate(gpus)),
                        nics=tuple(nics), pairs=tuple(pairs))


# --------------------------------------------------------------------------- the cluster YAML


def cluster_dict(
    host: HostTopology, *, name: str, trainer_nodes: int = 1, replicas: int = 1,
    gpus_per_replica: int | None = None, trainer_expert_parallel: int = 1,
    inference_expert_parallel: int = 1, fp8: bool = False, nic_gbps: float | None = None,
) -> dict:
    """A cluster config (the format of configs/clusters/*.yaml) of nodes like ``host``.

    Trainer nodes use every GPU of the node; a replica spans ``gpus_per_replica``
    GPUs (default: one node's) on whole nodes, or fewer GPUs of one node.
    ``nic_gbps`` overrides the port rate sysfs reports (needed when it reports none).
    """
    per_node = len(host.gpus)
    gbps = nic_gbps if nic_gbps is not None else host.nic_gbps
    if gbps is None:
        raise ValueError("the NICs' port rate is not in sysfs (ports/1/rate): pass nic_gbps")
    per_replica = gpus_per_replica or per_node
    if per_replica > per_node and per_replica % per_node:
        raise ValueError(f"gpus_per_replica={per_replica} must be at most one node's "
                         f"{per_node} GPUs or a multiple of it")
    nodes_per_replica = max(1, per_replica // per_node)
    engine_gpus = per_replica // nodes_per_replica
    return {
        "name": name,
        "description": (f"{trainer_nodes} trainer nodes and {replicas} replicas of "
                        f"{per_replica} GPUs; nodes of {per_node} GPUs and "
                        f"{len(host.nics)} RDMA NICs, read from sysfs"),
        "trainer": {
            "nodes": trainer_nodes, "gpus_per_node": per_node,
            "nics_per_node": len(host.nics), "nic_gbps": gbps,
            "gpu_nic": list(host.gpu_nic), "expert_parallel": trainer_expert_parallel,
        },
        "inference": {
            "replicas": replicas, "gpus_per_replica": per_replica,
            "tensor_parallel": per_replica, "expert_parallel": inference_expert_parallel,
            "nodes_per_replica": nodes_per_replica, "nics_per_node": len(host.nics),
            "nic_gbps": gbps, "gpu_nic": list(host.gpu_nic[:engine_gpus]), "fp8": fp8,
        },
    }


def describe(host: HostTopology) -> list[str]:
    """One line per GPU: its PCI address, NUMA node, NIC and why that NIC."""
    lines = []
    for p in host.pairs:
        g, n = host.gpus[p.gpu].pci, host.nics[p.nic]
        lines.append(f"GPU {p.gpu} {g.addr} (NUMA {g.numa}) -> NIC {p.nic} {n.name} "
                     f"{n.pci.addr} (NUMA {n.pci.numa}, {_rate(n)}): same {p.via}")
    return lines


def _rate(n: Nic) -> str:
    rate = f"{n.gbps:g} Gb/s" if n.gbps is not None else "rate unknown"
    return f"{rate} {n.link_layer}".strip()


def cluster_yaml(host: HostTopology, data: dict, *, source: str = "sysfs") -> str:
    """``data`` validated as a cluster config, as YAML headed by the hardware it came from."""
    config: ClusterConfig = cluster_from_dict(data, source=source)
    head = [f"# Cluster {config.name}, written by `wt topology` from {source}.",
            "# Each GPU sends through its nearest RDMA NIC (gpu_nic):"]
    head += [f"#   {line}" for line in describe(host)]
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
    return "\n".join(head) + "\n" + body


def host_dict(host: HostTopology) -> dict:
    """The hardware and the pairing as plain data (for ``--json``)."""
    return {
        "gpus": [{"index": g.index, "pci": g.pci.addr, "numa": g.pci.numa,
                  "pci_path": list(g.pci.path), "root": g.pci.root} for g in host.gpus],
        "nics": [{"index": n.index, "name": n.name, "pci": n.pci.addr, "numa": n.pci.numa,
                  "gbps": n.gbps, "link_layer": n.link_layer, "pci_path": list(n.pci.path),
                  "root": n.pci.root} for n in host.nics],
        "pairs": [{"gpu": p.gpu, "nic": p.nic, "shared_depth": p.shared_depth,
                   "same_numa": p.same_numa, "via": p.via} for p in host.pairs],
    }
