"""Node-aware NIC assignment on a simulated multi-node Ray cluster (ray.cluster_utils.Cluster).

Two Ray nodes carry the resources ``node_k`` (trainer node k of the cluster
config) and ``inode_k`` (inference replica k). The placement groups pin the
configured nodes to them; the plan's trainer ``RankInfo.node`` is the Ray node
each actor really runs on, and every task's sending NIC belongs to that node.
The pure naming rule is checked first without Ray.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
from actors.placement import trainer_rank_infos
from scheduling import load_cluster_config
from scheduling.serialize import loads_plan
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.sender.prepare import as_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LOCAL = CONFIGS / "clusters" / "local_cpu.yaml"


@pytest.mark.parametrize(
    "nodes, nics",
    [
        # As configured: 2 ranks per node, each GPU with its own NIC.
        (["A", "A", "B", "B"], ["tnode0/nic0", "tnode0/nic1", "tnode1/nic0", "tnode1/nic1"]),
        # One host for everything (local development): the simulated nodes stay apart.
        (["A", "A", "A", "A"], ["tnode0/nic0", "tnode0/nic1", "tnode1/nic0", "tnode1/nic1"]),
        # Placement interleaved the nodes: no NIC is shared across Ray nodes.
        (["A", "B", "A", "B"], ["tnode0/nic0", "tnode1/nic0", "tnode2/nic0", "tnode3/nic0"]),
    ],
)
def test_rank_nics_follow_the_real_nodes(nodes, nics):
    infos = trainer_rank_infos(load_cluster_config(LOCAL), nodes)
    assert [i.node for i in infos] == nodes
    assert [i.nic for i in infos] == nics
    owner: dict[str, str] = {}
    for i in infos:
        assert owner.setdefault(i.nic, i.node) == i.node


def test_rank_infos_refuse_wrong_counts_and_empty_nodes():
    cluster = load_cluster_config(LOCAL)
    with pytest.raises(ValueError, match="4 trainer ranks, got node ids of 3"):
        trainer_rank_infos(cluster, ["A", "A", "B"])
    with pytest.raises(ValueError, match="trainer rank 2 reported an empty node id"):
        trainer_rank_infos(cluster, ["A", "A", "", "B"])


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=4, resources={f"node_{k}": 4, f"inode_{k}": 4})
             for k in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield [n.node_id for n in nodes]
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plan_sends_through_the_nics_of_each_rank_s_real_node(two_nodes):
    node0, node1 = two_nodes
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml", LOCAL)
    trainers, replicas = launch_trainers(cfg), launch_engines(cfg)
    actual = ray.get([t.node_id.remote() for t in trainers])
    assert actual == [node0, node0, node1, node1]  # configured node k pinned to Ray node k
    assert [ray.get(rep[0].node_id.remote()) for rep in replicas] == [node0, node1]
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    plan = loads_plan(ray.get(ctl.scheduler.plan_blob.remote()))
    assert [r.node for r in plan.trainer_ranks] == actual
    assert [e.node for e in plan.engines] == [node0, node0, node1, node1]
    nic_node = {}
    for r in plan.trainer_ranks:
        assert nic_node.setdefault(r.nic, r.node) == r.node  # a NIC lives on one node
    src_node = np.array([plan.trainer_ranks[s].node for s in plan.task_src])
    send_nic = np.array(plan.send_nics)[plan.send_nic_of_task()]
    assert all(nic_node[n] == node for n, node in zip(send_nic, src_node, strict=True))
    per_node = {node: int(plan.task_nbytes()[src_node == node].sum()) for node in two_nodes}
    assert min(per_node.values()) > 0.4 * plan.bytes_total  # both nodes' NICs carry half
    # The plan runs across the two Ray nodes: bytes land exactly.
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(1))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    assert ctl.update(1).bytes == plan.bytes_total
    state = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    for actor in replicas[1]:
        meta = ray.get(actor.wt_engine_meta.remote())
        got = ray.get(actor.engine_state_bytes.remote())
        want = load_engine_shard(cfg.model, state, meta.shard, fp8=False)
        assert all(torch.equal(got[n], as_bytes(w).reshape(-1)) for n, w in want.items())
