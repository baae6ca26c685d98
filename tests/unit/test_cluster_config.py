"""Cluster YAML configs: shipped files, derived ranks, NICs and meshes, errors naming the field."""

from pathlib import Path

import pytest
import yaml

from scheduling.cluster.config import cluster_from_dict, load_cluster_config
from scheduling.config_metadata import trainer_meta_from_config
from weight_transfer.model.models import load_model_config
from weight_transfer.types import Placement

CLUSTERS = Path(__file__).resolve().parents[2] / "configs" / "clusters"


def small(**changes):
    data = {
        "name": "t",
        "trainer": {"nodes": 2, "gpus_per_node": 4, "nics_per_node": 2, "nic_gbps": 100},
        "inference": {
            "replicas": 2,
            "gpus_per_replica": 4,
            "tensor_parallel": 4,
            "expert_parallel": 2,
            "nodes_per_replica": 2,
            "nics_per_node": 2,
            "nic_gbps": 200,
        },
    }
    for path, value in changes.items():
        section, _, key = path.rpartition("__")
        target = data[section] if section else data
        target[key] = value
    return data


def test_perplexity_cluster_matches_the_reference_setup():
    c = load_cluster_config(CLUSTERS / "perplexity_kimi_k2.yaml")
    assert (c.trainer_world, c.engine_world) == (256, 128)
    assert len(c.trainer_nics()) == 256 and len(c.engine_nics()) == 128
    assert c.send_bytes_per_s == c.recv_bytes_per_s == 50e9
    assert c.inference.fp8
    # one NIC per GPU on both sides
    assert len({c.rank_info(r).nic for r in range(256)}) == 256
    nics = {c.engine_rank(rep, i)[1] for rep in range(8) for i in range(16)}
    assert len(nics) == 128


def test_perplexity_hsdp_cluster_keeps_every_gather_inside_a_node():
    base = load_cluster_config(CLUSTERS / "perplexity_kimi_k2.yaml")
    c = load_cluster_config(CLUSTERS / "perplexity_kimi_k2_hsdp.yaml")
    # the same hardware and engines as the reference setup; only the trainer layout differs
    assert c.inference == base.inference and c.sim == base.sim
    assert (c.trainer.nodes, c.trainer.gpus_per_node, c.trainer.nic_gbps) == (32, 8, 400)
    node = [c.rank_info(r).node for r in range(c.trainer_world)]
    mesh = c.dense_mesh()
    assert mesh.shape == (32, 8) and c.dense_placements() == (REPLICATE, SHARD0)
    for i in range(32):  # each replica group's FSDP ring: one node
        assert len({node[r] for r in mesh.ranks[8 * i:8 * i + 8]}) == 1
    meshes = c.expert_meshes()
    assert len(meshes) == 32 and all(len({node[r] for r in m.ranks}) == 1 for m in meshes)


def test_local_cpu_cluster_is_small():
    c = load_cluster_config(CLUSTERS / "local_cpu.yaml")
    assert c.trainer_world == 4 and c.engine_world == 4
    assert [r.nic for r in c.rank_infos()] == [
        "tnode0/nic0", "tnode0/nic1", "tnode1/nic0", "tnode1/nic1"
    ]


@pytest.mark.parametrize(
    ("gpus", "nics", "gpu_nic", "expected"),
    [
        (4, 2, None, [0, 0, 1, 1]),  # spread evenly by default
        (4, 4, None, [0, 1, 2, 3]),
        (4, 2, (1, 0, 1, 0), [1, 0, 1, 0]),  # explicit table
        (4, 1, None, [0, 0, 0, 0]),
    ],
)
def test_gpu_to_nic_mapping(gpus, nics, gpu_nic, expected):
    data = small(trainer__gpus_per_node=gpus, trainer__nics_per_node=nics)
    if gpu_nic:
        data["trainer"]["gpu_nic"] = list(gpu_nic)
    c = cluster_from_dict(data)
    assert [c.trainer_nic_index(r) for r in range(gpus)] == expected
    # second node's NICs follow the first node's
    assert c.trainer_nic_index(gpus) == nics + expected[0]


@pytest.mark.parametrize(
    ("layout", "meshes"),
    [
        ("strided", [(0, 2, 4, 6), (1, 3, 5, 7)]),
        ("contiguous", [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ],
)
def test_expert_meshes_are_disjoint_and_cover_all_ranks(layout, meshes):
    c = cluster_from_dict(small(trainer__expert_parallel=2, trainer__expert_mesh_layout=layout))
    assert [m.ranks for m in c.expert_meshes()] == meshes
    assert [c.expert_mesh_index(e, 8) for e in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    stacked, placements = c.stacked_expert_mesh()
    assert sorted(stacked.ranks) == list(range(8)) and stacked.shape == (2, 4)
    assert len(placements) == 2


def test_engine_ranks_nodes_nics_and_shards():
    c = cluster_from_dict(small())
    # replica 1, local 3: second node of replica 1 = inode3; 2 GPUs per node over 2 NICs
    node, nic, shard = c.engine_rank(1, 3)
    assert (node, nic) == ("inode3", "inode3/nic1")
    assert (shard.tp_rank, shard.tp_size, shard.ep_rank, shard.ep_size) == (3, 4, 1, 2)
    assert c.shard_of(1).ep_rank == 0


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"trainer__bogus": 1}, "field trainer.bogus"),
        ({"trainer__nodes": 0}, "field trainer.nodes"),
        ({"trainer__nic_gbps": "fast"}, "field trainer.nic_gbps"),
        ({"inference__tensor_parallel": 2}, "tensor_parallel=2 must equal gpus_per_replica=4"),
        ({"inference__expert_parallel": 3}, "expert_parallel=3 does not divide"),
        ({"inference__nodes_per_replica": 3}, "nodes_per_replica=3 does not divide"),
        ({"trainer__expert_parallel": 3}, "expert_parallel=3 does not divide the 8"),
        ({"trainer__gpu_nic": [0, 1]}, "gpu_nic has 2 entries but a node has 4 GPUs"),
        ({"trainer__gpu_nic": [0, 1, 2, 5]}, "gpu_nic names NICs [2, 5] outside [0, 2)"),
        ({"trainer__expert_mesh_layout": "diagonal"}, "field trainer.expert_mesh_layout"),
        ({"trainer__replicate": 3}, "replicate=3 does not divide the 8 trainer ranks"),
        ({"trainer__replicate": 0}, "field trainer.replicate"),
    ],
)
def test_bad_config_errors_name_file_and_field(tmp_path, changes, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(small(**changes)))
    with pytest.raises(ValueError) as err:
        load_cluster_config(path)
    assert str(path) in str(err.value)
    assert needle in str(err.value)


SHARD0, REPLICATE = Placement(kind="shard", dim=0), Placement(kind="replicate")


def test_dense_mesh_is_fsdp_over_every_rank_without_replicate():
    c = cluster_from_dict(small())
    mesh = c.dense_mesh()
    assert (mesh.ranks, mesh.shape, mesh.dim_names) == (tuple(range(8)), (8,), ("dp_shard",))
    assert c.dense_placements() == (SHARD0,)


@pytest.mark.parametrize(("replicate", "groups"), [
    (2, [(0, 1, 2, 3), (4, 5, 6, 7)]),  # one replica per node: gathers stay in a node
    (4, [(0, 1), (2, 3), (4, 5), (6, 7)]),
    (8, [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]),
])
def test_hsdp_dense_mesh_rows_are_contiguous_replica_groups(replicate, groups):
    c = cluster_from_dict(small(trainer__replicate=replicate))
    mesh = c.dense_mesh()
    shard = 8 // replicate
    assert mesh.shape == (replicate, shard)
    assert mesh.dim_names == ("dp_replicate", "dp_shard")
    rows = [mesh.ranks[i * shard:(i + 1) * shard] for i in range(replicate)]  # row-major
    assert rows == groups
    assert c.dense_placements() == (REPLICATE, SHARD0)


def test_hsdp_places_dense_params_on_the_2d_mesh_and_experts_unchanged():
    cfg = load_model_config(Path(__file__).resolve().parents[2] / "configs" / "models"
                            / "tiny_moe.yaml")
    flat = trainer_meta_from_config(cfg, cluster_from_dict(small(trainer__expert_parallel=2)))
    hsdp = trainer_meta_from_config(
        cfg, cluster_from_dict(small(trainer__expert_parallel=2, trainer__replicate=2)))
    changed = 0
    for a, b in zip(flat.params, hsdp.params, strict=True):
        assert (a.name, a.shape, a.dtype) == (b.name, b.shape, b.dtype)
        if a.mesh.shape == (8,):  # dense: FSDP over all 8 ranks -> HSDP 2 x 4
            assert b.mesh.shape == (2, 4) and b.placements == (REPLICATE, SHARD0)
            changed += 1
        else:  # experts keep their meshes and placements
            assert (b.mesh, b.placements) == (a.mesh, a.placements)
    assert changed and changed < len(flat.params)


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read cluster config"):
        load_cluster_config(tmp_path / "missing.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"list\.yaml: a cluster config must be a mapping"):
        load_cluster_config(path)


def test_out_of_range_ranks_and_experts():
    c = cluster_from_dict(small(trainer__expert_parallel=2))
    with pytest.raises(ValueError, match="trainer rank 8 outside"):
        c.rank_info(8)
    with pytest.raises(ValueError, match="engine rank"):
        c.engine_rank(2, 0)
    with pytest.raises(ValueError, match="does not divide the model's 7 experts"):
        c.expert_mesh_index(0, 7)
