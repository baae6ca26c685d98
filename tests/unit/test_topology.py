"""`wt topology`: GPUs and RDMA NICs read from sysfs trees laid out as the kernel does.

The fixture trees are built here in a temp dir: PCI functions nested under
their host bridge, root port and PCIe switch ports in ``devices/pci*``,
``bus/pci/devices/<addr>`` links to them, ``class/infiniband/<dev>`` links
with a ``device`` link to the NIC's PCI function, ``numa_node`` files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from actors.tools.cli.main import app
from actors.tools.cli.topology_cmd import EXIT_NO_HARDWARE, run
from scheduling import load_cluster_config
from scheduling.cluster.topology import (
    NoHardwareError,
    PciDevice,
    cluster_dict,
    cluster_yaml,
    pair_gpus,
    parse_rate,
    read_host,
    shared_depth,
)

GPU, NIC, BRIDGE, NVSWITCH = ("0x10de", "0x030200"), ("0x15b3", "0x020700"), \
    ("0x1000", "0x060400"), ("0x10de", "0x068000")


class SysfsTree:
    """Writes PCI functions and RDMA devices the way sysfs exposes them."""

    def __init__(self, root: Path):
        self.root = root
        (root / "bus" / "pci" / "devices").mkdir(parents=True)
        (root / "class" / "infiniband").mkdir(parents=True)

    def device(self, chain: tuple[str, ...], kind: tuple[str, str], numa: int) -> Path:
        """A PCI function at the end of ``chain`` (host bridge first); bridges on the way."""
        where = self.root / "devices"
        for i, part in enumerate(chain):
            where = where / part
            if i == 0:
                where.mkdir(parents=True, exist_ok=True)
                continue
            last = i == len(chain) - 1
            self._function(where, kind if last else BRIDGE, numa)
        return where

    def _function(self, where: Path, kind: tuple[str, str], numa: int) -> None:
        if where.exists():
            return
        where.mkdir(parents=True)
        vendor, cls = kind
        (where / "vendor").write_text(vendor + "\n")
        (where / "class").write_text(cls + "\n")
        (where / "numa_node").write_text(f"{numa}\n")
        link = self.root / "bus" / "pci" / "devices" / where.name
        link.symlink_to(os.path.relpath(where, link.parent))

    def rdma(self, name: str, pci_dir: Path, *, rate="400 Gb/sec (4X NDR)",
             layer="InfiniBand") -> None:
        dev = pci_dir / "infiniband" / name
        (dev / "ports" / "1").mkdir(parents=True)
        (dev / "ports" / "1" / "rate").write_text(rate + "\n")
        (dev / "ports" / "1" / "link_layer").write_text(layer + "\n")
        (dev / "device").symlink_to("../..")
        link = self.root / "class" / "infiniband" / name
        link.symlink_to(os.path.relpath(dev, link.parent))


def switch_chain(bus: int, port: int, leaf_bus: int) -> tuple[str, ...]:
    """Host bridge -> root port -> switch upstream -> downstream ``port`` -> function."""
    b = f"{bus:02x}"
    return (f"pci0000:{b}", f"0000:{b}:01.0", f"0000:{bus + 1:02x}:00.0",
            f"0000:{bus + 2:02x}:{port:02x}.0", f"0000:{leaf_bus:02x}:00.0")


# NIC names do not follow PCI order: the NIC beside GPU k (in switch k) is mlx5_NAMES[k].
NAMES = [3, 0, 1, 2, 7, 4, 5, 6]
BUSES = [0x15, 0x2a, 0x3f, 0x54, 0x9a, 0xab, 0xbd, 0xcc]


@pytest.fixture
def dgx(tmp_path) -> Path:
    """8 GPUs and 8 NICs, each GPU and one NIC under their own PCIe switch, 2 NUMA nodes."""
    tree = SysfsTree(tmp_path / "sys")
    for k, bus in enumerate(BUSES):
        numa = k // 4
        tree.device(switch_chain(bus, 0, bus + 3), GPU, numa)
        nic = tree.device(switch_chain(bus, 1, bus + 4), NIC, numa)
        tree.rdma(f"mlx5_{NAMES[k]}", nic)
    # NVSwitches are NVIDIA bridges, not GPUs.
    for j in range(4):
        tree.device(("pci0000:e0", "0000:e0:01.0", f"0000:e{j + 1}:00.0"), NVSWITCH, 1)
    return tmp_path / "sys"


def test_each_gpu_gets_the_nic_behind_its_own_switch(dgx):
    host = read_host(dgx)
    assert [g.pci.addr for g in host.gpus] == [f"0000:{b + 3:02x}:00.0" for b in BUSES]
    assert [n.name for n in host.nics] == [f"mlx5_{i}" for i in range(8)]
    assert host.gpu_nic == tuple(NAMES)  # not the naive 0..7
    assert all(p.via == "PCIe switch" and p.same_numa for p in host.pairs)
    assert [g.pci.numa for g in host.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert host.nic_gbps == 400.0
    assert host.nics[0].link_layer == "InfiniBand"


def test_the_yaml_loads_as_a_cluster_config(dgx, tmp_path):
    host = read_host(dgx)
    data = cluster_dict(host, name="dgx", trainer_nodes=4, replicas=2, gpus_per_replica=16,
                        trainer_expert_parallel=8, fp8=True)
    path = tmp_path / "dgx.yaml"
    path.write_text(cluster_yaml(host, data))
    cfg = load_cluster_config(path)
    assert (cfg.trainer.nodes, cfg.trainer.gpus_per_node, cfg.trainer.nics_per_node) == (4, 8, 8)
    assert cfg.trainer.gpu_nic == tuple(NAMES) and cfg.inference.gpu_nic == tuple(NAMES)
    assert (cfg.inference.nodes_per_replica, cfg.inference.tensor_parallel) == (2, 16)
    assert cfg.trainer.nic_gbps == cfg.inference.nic_gbps == 400.0
    assert cfg.rank_info(9).nic == f"tnode1/nic{NAMES[1]}"
    assert "# Each GPU sends through its nearest RDMA NIC" in path.read_text()


def test_gpus_sharing_a_switch_with_two_nics_are_spread_over_them(tmp_path):
    tree = SysfsTree(tmp_path / "sys")
    for k in range(2):
        tree.device(switch_chain(0x15, k, 0x18 + k), GPU, 0)
    for k in range(2):
        tree.rdma(f"mlx5_{k}", tree.device(switch_chain(0x15, 2 + k, 0x1a + k), NIC, 0))
    assert read_host(tmp_path / "sys").gpu_nic == (0, 1)


def test_without_a_shared_bridge_the_numa_node_decides(tmp_path):
    tree = SysfsTree(tmp_path / "sys")
    for k in range(4):
        tree.device((f"pci0000:{0x10 + k:02x}", f"0000:{0x10 + k:02x}:01.0",
                     f"0000:{0x20 + k:02x}:00.0"), GPU, k // 2)
    for k, numa in enumerate([1, 0]):  # mlx5_0 on NUMA 1, mlx5_1 on NUMA 0
        nic = tree.device((f"pci0000:{0x80 + k:02x}", f"0000:{0x80 + k:02x}:01.0",
                           f"0000:{0x90 + k:02x}:00.0"), NIC, numa)
        tree.rdma(f"mlx5_{k}", nic, rate="200 Gb/sec (4X HDR)", layer="Ethernet")
    host = read_host(tmp_path / "sys")
    assert host.gpu_nic == (1, 1, 0, 0)
    assert {p.via for p in host.pairs} == {"NUMA node"}
    assert host.nic_gbps == 200.0


P = PciDevice


@pytest.mark.parametrize(
    ("a", "b", "depth"),
    [
        (P(addr="x", path=("r", "s", "x"), root="pci0", numa=0),
         P(addr="y", path=("r", "s", "y"), root="pci0", numa=0), 3),
        (P(addr="x", path=("r", "x"), root="pci0", numa=0),
         P(addr="y", path=("q", "y"), root="pci0", numa=0), 1),
        (P(addr="x", path=("r", "x"), root="pci0", numa=0),
         P(addr="y", path=("r", "y"), root="pci1", numa=0), 0),
    ],
)
def test_shared_depth(a, b, depth):
    assert shared_depth(a, b) == depth == shared_depth(b, a)


def test_pairing_prefers_depth_over_numa_over_load():
    gpu = P(addr="g", path=("r", "s", "g"), root="pci0", numa=0)
    near_other_numa = P(addr="n0", path=("r", "s", "n0"), root="pci0", numa=1)
    far_same_numa = P(addr="n1", path=("q", "n1"), root="pci1", numa=0)
    pairs = pair_gpus([gpu, gpu], [far_same_numa, near_other_numa])
    assert [p.nic for p in pairs] == [1, 1]  # the switch wins even when already used
    assert pairs[0].via == "PCIe switch" and not pairs[0].same_numa


@pytest.mark.parametrize(("text", "gbps"), [("400 Gb/sec (4X NDR)", 400.0),
                                            ("25 Gb/sec (1X EDR)", 25.0), ("", None)])
def test_parse_rate(text, gbps):
    assert parse_rate(text) == gbps


def test_an_empty_tree_says_what_is_missing(tmp_path):
    with pytest.raises(NoHardwareError, match=r"no NVIDIA GPU .* no RDMA device under"):
        read_host(tmp_path)
    rc = run(sysfs=tmp_path, out=tmp_path / "c.yaml", json_path=None, name="x",
             trainer_nodes=1, replicas=1, gpus_per_replica=None, trainer_expert_parallel=1,
             inference_expert_parallel=1, fp8=False, nic_gbps=None)
    assert rc == EXIT_NO_HARDWARE == 3
    assert not (tmp_path / "c.yaml").exists()


def test_a_software_rdma_device_without_pci_function_is_skipped(dgx):
    netdev = dgx / "devices" / "virtual" / "net" / "eth0"
    netdev.mkdir(parents=True)
    dev = netdev / "infiniband" / "rxe0"
    dev.mkdir(parents=True)
    (dev / "device").symlink_to("../..")
    (dgx / "class" / "infiniband" / "rxe0").symlink_to(os.path.relpath(dev, dgx / "class" /
                                                                       "infiniband"))
    assert len(read_host(dgx).nics) == 8


def test_the_command_writes_yaml_and_json(dgx, tmp_path):
    out, js = tmp_path / "c.yaml", tmp_path / "t.json"
    res = CliRunner().invoke(app, ["topology", "--sysfs", str(dgx), "--out", str(out),
                                   "--json", str(js), "--trainer-nodes", "2", "--name", "dgx"])
    assert res.exit_code == 0, res.output
    assert load_cluster_config(out).trainer.gpu_nic == tuple(NAMES)
    data = json.loads(js.read_text())
    assert [p["nic"] for p in data["pairs"]] == NAMES
    assert data["cluster"]["trainer"]["nodes"] == 2
    assert yaml.safe_load(out.read_text())["name"] == "dgx"


@pytest.mark.skipif(Path("/sys/class/infiniband").is_dir(), reason="this host has RDMA devices")
def test_this_machine_reports_that_there_is_nothing():
    res = CliRunner().invoke(app, ["topology"])
    assert res.exit_code == EXIT_NO_HARDWARE
    assert "no RDMA device under /sys/class/infiniband" in " ".join(res.output.split())
