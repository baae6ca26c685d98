"""msgpack round trips of whole plans and of what each trainer receives."""

from pathlib import Path

import msgpack
import numpy as np
import pytest

from scheduling import compute_plan
from scheduling.cluster.config import load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from scheduling.serialize import dumps_plan, loads_plan
from weight_transfer.model.models import load_model_config
from weight_transfer.plan.wire import dumps_trainer_plan, loads_trainer_plan

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("task_piece", "task_src", "task_dst", "task_region", "task_offset", "task_group",
           "trainer_ptr")


@pytest.fixture(scope="module", params=[("tiny_deepseek_v3", True, "shard_direct"),
                                        ("tiny_qwen2", False, "shard_direct"),
                                        ("tiny_qwen2", False, "full")])
def plan(request):
    name, fp8, gather = request.param
    cfg = load_model_config(ROOT / f"configs/models/{name}.yaml")
    cl = load_cluster_config(ROOT / "configs/clusters/local_cpu.yaml")
    tm = trainer_meta_from_config(cfg, cl)
    em = engine_metas_from_config(cfg, cl, fp8=fp8)
    return compute_plan(tm, em, cl, model=cfg, fp8=fp8, min_piece_bytes=1024, gather=gather)


def test_plan_round_trip(plan):
    back = loads_plan(dumps_plan(plan))
    for c in COLUMNS:
        assert getattr(back, c).dtype == getattr(plan, c).dtype
        assert np.array_equal(getattr(back, c), getattr(plan, c)), c
    for field in ("params", "trainer_ranks", "engines", "pieces", "regions", "send_nics",
                  "recv_nics", "meshes", "mesh_group", "param_mesh", "group_params",
                  "gather", "direct_params", "fallback"):
        assert getattr(back, field) == getattr(plan, field), field
    back.validate()
    assert dumps_plan(back) == dumps_plan(plan)


def test_trainer_plan_round_trip_is_exact_and_deduplicated(plan):
    for r in plan.trainer_ranks:
        tp = plan.trainer_plan(r.rank)
        blob = dumps_trainer_plan(tp)
        assert loads_trainer_plan(blob) == tp
        raw = msgpack.unpackb(blob)
        tasks = tp.tasks
        assert len(raw["pieces"]) == len({t.piece for t in tasks})
        assert len(raw["regions"]) == len({t.region for t in tasks})
        assert len(raw["strings"]) == len(set(raw["strings"]))
        # names live only in the string table; pieces, regions and tasks hold indices
        for row in raw["pieces"] + raw["regions"]:
            assert all(isinstance(v, int | list) for v in row), row
        for _group, _mesh, params, flat, local in raw["groups"]:
            assert all(isinstance(v, int) for v in params + flat + local)
        assert any(g.local for g in tp.groups) == bool(plan.direct_params)


def test_wrong_or_corrupt_blobs(plan):
    with pytest.raises(ValueError, match="not a trainer_plan blob of format 1"):
        loads_trainer_plan(dumps_plan(plan))
    with pytest.raises(ValueError, match="not a plan blob"):
        loads_plan(msgpack.packb([1, 2, 3]))
    blob = msgpack.unpackb(dumps_trainer_plan(plan.trainer_plan(0)))
    blob["format"] = 99
    with pytest.raises(ValueError, match=r"got \('trainer_plan', 99\)"):
        loads_trainer_plan(msgpack.packb(blob))
