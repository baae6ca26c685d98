"""Planning with HSDP dense parameters (2-D mesh ``(dp_replicate, dp_shard)``).

After ``full_tensor()`` (a gather along ``dp_shard`` only) every rank of the
2-D mesh holds the whole tensor, so any rank may send it: the planner treats
the mesh by its rank set, spreads sources over every trainer NIC, and the
plan is the FSDP plan's, task for task.
"""

from pathlib import Path

import numpy as np
import pytest

from scheduling import compute_plan
from scheduling.build.assign import assign_sources, mesh_groups
from scheduling.cluster.config import load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scheduling.serialize import dumps_plan, loads_plan
from weight_transfer.model.models import load_model_config
from weight_transfer.plan.wire import dumps_trainer_plan, loads_trainer_plan
from weight_transfer.types import Placement

ROOT = Path(__file__).resolve().parents[2]
TASK_COLUMNS = ("task_piece", "task_src", "task_dst", "task_region", "task_offset",
                "task_group", "trainer_ptr")


def _plan(model: str, replicate: int, **trainer):
    cl = load_cluster_config(ROOT / "configs/clusters/local_cpu.yaml")
    cl = cl.model_copy(update={"trainer": cl.trainer.model_copy(
        update={"replicate": replicate, **trainer})})
    cfg = load_model_config(ROOT / "configs/models" / model)
    tm = trainer_meta_from_config(cfg, cl)
    # gather="full": after the gather every rank of a mesh holds the tensor, so HSDP and FSDP
    # plan alike (shard-direct sources differ by ownership: tests/unit/test_direct.py)
    return compute_plan(tm, engine_metas_from_config(cfg, cl), cl, model=cfg,
                        gather="full"), cl


@pytest.mark.parametrize("model", ["tiny_llama.yaml", "tiny_moe.yaml"])
@pytest.mark.parametrize("replicate", [2, 4])
def test_hsdp_plan_is_the_fsdp_plan_and_validates(model, replicate):
    fsdp, _ = _plan(model, 1)
    hsdp, cl = _plan(model, replicate)
    hsdp.validate()
    dense = [p for p in hsdp.params if len(p.mesh.shape) == 2 and p.mesh.dim_names[0]
             == "dp_replicate"]
    assert dense, "no parameter landed on the HSDP mesh"
    assert all(p.placements == (Placement(kind="replicate"), Placement(kind="shard", dim=0))
               and p.mesh.shape == (replicate, cl.trainer_world // replicate) for p in dense)
    for col in TASK_COLUMNS:
        np.testing.assert_array_equal(getattr(hsdp, col), getattr(fsdp, col), err_msg=col)
    assert hsdp.group_params == fsdp.group_params


def test_hsdp_dense_sources_spread_over_every_trainer_nic():
    plan, cl = _plan("tiny_llama.yaml", 2)
    sent = plan.send_bytes().sum(axis=0)
    assert len(sent) == len(cl.trainer_nics()) == 4
    assert (sent > 0).all()
    assert sent.max() / sent.mean() < 1.2  # balanced, not only the first replica group
    src = set(plan.task_src.tolist())
    assert src == set(range(cl.trainer_world))  # ranks of both replica groups send
    assert plan.num_groups == 1  # tiny_llama: dense only, one group on the 2-D mesh


@pytest.mark.parametrize(("ranks", "nics", "expected"), [
    # 2 x 2 HSDP mesh, rows = replica groups on two nodes; one rank per NIC
    ((0, 1, 2, 3), [0, 1, 2, 3], [2, 2, 2, 2]),
    # 2 x 4 mesh over 2 nodes of 2 NICs: 8 ranks, two per NIC
    ((0, 1, 2, 3, 4, 5, 6, 7), [0, 0, 1, 1, 2, 2, 3, 3], [1] * 8),
    # 2 x 2 mesh, two ranks per NIC: each NIC's bytes split over its two ranks
    ((0, 1, 2, 3), [0, 0, 1, 1], [2, 2, 2, 2]),
])
def test_assign_sources_over_a_2d_mesh_uses_every_rank(ranks, nics, expected):
    nbytes = np.full(8, 100, dtype=np.int64)
    rank_nic = np.asarray(nics)
    nic_load, rank_load = np.zeros(max(nics) + 1, np.int64), np.zeros(len(ranks), np.int64)
    src = assign_sources(nbytes, ranks, rank_nic, nic_load, rank_load)
    assert np.bincount(src, minlength=len(ranks)).tolist() == expected
    assert rank_load.tolist() == [c * 100 for c in expected]


def test_hsdp_mesh_over_every_rank_forms_group_0():
    # the HSDP mesh holds every rank, like FSDP's: the dense group, before the experts'
    hsdp = (0, 1, 2, 3, 4, 5, 6, 7)  # 2 x 4, row-major
    assert mesh_groups([(0, 2, 4, 6), hsdp, (1, 3, 5, 7)]) == [[1], [0, 2]]


def test_hsdp_plan_round_trips_with_its_2d_mesh_and_placements():
    plan, _ = _plan("tiny_moe.yaml", 2)
    back = loads_plan(dumps_plan(plan))
    assert back.params == plan.params  # meshes (2-D, dim names) and placements kept
    tp = loads_trainer_plan(dumps_trainer_plan(plan.trainer_plan(3)))
    assert tp == plan.trainer_plan(3)
