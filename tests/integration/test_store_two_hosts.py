"""Stores every node reaches: Ray nodes on two loopback addresses, 127.0.0.2 and 127.0.0.3.

The driver (the head node) is on 127.0.0.2, a second Ray node on 127.0.0.3.
A store is hosted on the address Ray reports for its host's node and listens
on that address only, so a hard-coded address (127.0.0.1, or the other
node's) fails here as it would across real hosts. A group store is reached
from the other host; the trainers' barrier store (the controller's, on the
driver's node) is reached from the trainers, which all run on the other
host with the engines (so the data plane, simnic, stays on one host); the
barrier's keys do not pile up over updates.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from ray.cluster_utils import Cluster

from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
from actors.groups import GroupMember, connect_store
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.sync.barrier import BarrierKey, StoreBarrier

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
IPS = ("127.0.0.2", "127.0.0.3")


@pytest.fixture(scope="module")
def two_hosts():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": IPS[0], "resources": {"host_0": 4}})
    # Every configured trainer node and inference node is the Ray node on 127.0.0.3.
    cluster.add_node(num_cpus=8, node_ip_address=IPS[1], resources={
        "node_0": 4, "node_1": 4, "inode_0": 4, "inode_1": 4, "host_1": 4})
    ray.init(address=cluster.address, _node_ip_address=IPS[0], log_to_driver=False)
    cluster.wait_for_nodes()
    yield
    ray.shutdown()
    cluster.shutdown()


@ray.remote(num_cpus=0)
class StoreProbe(GroupMember):
    """A group member that hosts or joins a store and passes barriers on it."""

    def __init__(self):
        self.config = type("Cfg", (), {"setup_timeout_s": 30.0})()
        self._store = None
        self.client = None

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def join(self, host: str, port: int) -> None:
        self.client = connect_store(host, port, timeout_s=30)

    def can_reach(self, host: str, port: int) -> bool:
        try:
            dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=1))
        except (RuntimeError, dist.DistNetworkError):
            return False
        return True

    def barriers(self, rank: int, tags: list[str], key: BarrierKey) -> None:
        barrier = StoreBarrier(self.client, rank=rank, ranks=[0, 1], key=key, timeout_s=30)
        for tag in tags:
            barrier.wait(tag)

    def num_keys(self) -> int:
        return self._store.num_keys()


def on_host(k: int):
    return StoreProbe.options(resources={f"host_{k}": 1}).remote()


@pytest.mark.timeout(300)
def test_a_group_store_is_hosted_on_its_node_and_reached_from_the_other(two_hosts):
    host1, host0 = on_host(1), on_host(0)
    assert ray.get([host0.node_ip.remote(), host1.node_ip.remote()]) == list(IPS)
    addr, port = ray.get(host1.host_store.remote())  # rank 0 of the group is on 127.0.0.3
    assert addr == IPS[1]
    assert ray.get(host0.can_reach.remote(IPS[1], port))
    for wrong in ("127.0.0.1", IPS[0]):  # a hard-coded address does not reach it
        assert not ray.get(host0.can_reach.remote(wrong, port)), wrong
    ray.get([host0.join.remote(addr, port), host1.join.remote(addr, port)])
    base = ray.get(host1.num_keys.remote())
    tags = [f"v{v}/g{g}" for v in range(1, 26) for g in range(2)]
    key = BarrierKey.new()  # over Ray, as the controller hands it out
    ray.get([host0.barriers.remote(0, tags, key), host1.barriers.remote(1, tags, key)])
    assert ray.get(host1.num_keys.remote()) == base  # 50 crossings, no key left behind


@pytest.mark.timeout(600)
def test_the_controller_s_barrier_store_is_reached_from_trainers_on_the_other_host(two_hosts):
    # The demo's smallest shape (2 trainer ranks, 1 replica x TP1): the store is the subject.
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    CONFIGS / "clusters" / "local_cpu_small.yaml")
    trainers, replicas = launch_trainers(cfg), launch_engines(cfg)
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = ray.get([t.node_id.remote() for t in trainers])
    assert len(set(nodes)) == 1 and driver_node not in nodes  # every rank on 127.0.0.3
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    assert ctl.state.store_host == IPS[0]  # the driver's node, not loopback 127.0.0.1
    base = ctl.state.store.num_keys()
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(1))
    for version in (1, 2, 3):
        ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
        report = ctl.update(version)
        assert report.bytes > 0
    assert ctl.state.store.num_keys() == base  # the barrier keys of 3 updates are gone
    state = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    for actor in replicas[0]:
        meta = ray.get(actor.wt_engine_meta.remote())
        got = ray.get(actor.engine_state_bytes.remote())
        want = load_engine_shard(cfg.model, state, meta.shard, fp8=False)
        assert all(torch.equal(got[n], as_bytes(w).reshape(-1)) for n, w in want.items())
    ctl.shutdown()
