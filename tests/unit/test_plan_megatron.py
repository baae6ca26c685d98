"""Plans from a Megatron trainer layout (``trainer.megatron`` in a cluster YAML), pure.

The layout's validation errors name the file, the field and the value; small models
planned from TP/PP/EP/VPP layouts write every engine byte exactly once from the ranks
Megatron keeps them on; Kimi-K2 from the Kimi-K2 report's layout onto the Perplexity
cluster plans and simulates (structure only: timings are not asserted).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from scheduling import compute_plan, load_cluster_config, simulate
from scheduling.cluster.megatron import MegatronLayout, layer_stages
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.model.models import load_model_config

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "models"

# 8 trainer ranks (2 nodes x 4) -> 2 replicas x TP2
BASE = {
    "name": "megatron_small",
    "trainer": {"nodes": 2, "gpus_per_node": 4, "nics_per_node": 2, "nic_gbps": 8,
                "megatron": {"tensor_parallel": 2, "pipeline_parallel": 2}},
    "inference": {"replicas": 2, "gpus_per_replica": 2, "tensor_parallel": 2,
                  "nics_per_node": 2, "nic_gbps": 8},
}


def write(tmp_path: Path, megatron: dict | None = None, **trainer) -> Path:
    data = copy.deepcopy(BASE)
    if megatron is not None:
        data["trainer"]["megatron"] = megatron
    data["trainer"] |= trainer
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("megatron", "trainer", "needle"), [
    ({"tensor_parallel": 3}, {},
     "field trainer.megatron.tensor_parallel x pipeline_parallel = 3 x 1 = 3 does not divide "
     "the 8 trainer ranks"),
    ({"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 3}, {},
     "megatron.expert_parallel x expert_tensor_parallel = 3 x 1 = 3 does not divide a "
     "pipeline stage's 4 ranks"),
    ({"tensor_parallel": 2, "pipeline_parallel": 2, "stage_layers": [1, 1, 1]}, {},
     "field trainer.megatron.stage_layers has 3 entries, pipeline_parallel x "
     "virtual_pipeline = 2 x 1 = 2"),
    ({"tensor_parallel": 2, "stage_layers": [-1]}, {}, "stage_layers holds a negative count"),
    ({"tensor_parallel": 0}, {}, "field trainer.megatron.tensor_parallel: Input should be "
     "greater than or equal to 1 (got 0)"),
    ({"tensor_parallel": 2, "tensorparallel": 2}, {}, "field trainer.megatron.tensorparallel"),
    ({"tensor_parallel": 2}, {"expert_parallel": 2},
     "field trainer.expert_parallel lays out an FSDP trainer; with megatron set"),
])
def test_bad_layouts_name_the_file_field_and_value(tmp_path, megatron, trainer, needle):
    path = write(tmp_path, megatron, **trainer)
    with pytest.raises(ValueError) as err:
        load_cluster_config(path)
    assert str(path) in str(err.value) and needle in str(err.value)


@pytest.mark.parametrize(("model", "megatron", "needle"), [
    ("tiny_moe", {"tensor_parallel": 2, "pipeline_parallel": 2},
     "the model's 3 layers do not split evenly over trainer.megatron pipeline_parallel x "
     "virtual_pipeline = 2 x 1 = 2 virtual stages; set trainer.megatron.stage_layers"),
    ("tiny_moe", {"tensor_parallel": 2, "pipeline_parallel": 2, "stage_layers": [2, 2]},
     "trainer.megatron.stage_layers sums to 4, the model has 3 layers"),
    ("tiny_llama", {"tensor_parallel": 1, "expert_parallel": 8}, None),  # no experts: fine
])
def test_layouts_that_do_not_fit_the_model_name_the_cluster(tmp_path, model, megatron, needle):
    path = write(tmp_path, megatron)
    cfg, cl = load_model_config(MODELS / f"{model}.yaml"), load_cluster_config(path)
    if needle is None:
        trainer_meta_from_config(cfg, cl)
        return
    with pytest.raises(ValueError) as err:
        trainer_meta_from_config(cfg, cl)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_ep_must_divide_the_experts(tmp_path):
    cl = load_cluster_config(write(tmp_path, {"tensor_parallel": 1, "pipeline_parallel": 1,
                                              "expert_parallel": 8,
                                              "stage_layers": [3]}))
    cfg = load_model_config(MODELS / "tiny_moe.yaml").model_copy(update={"num_experts": 12})
    with pytest.raises(ValueError, match="expert_parallel=8 does not divide the model's 12"):
        trainer_meta_from_config(cfg, cl)


def test_virtual_stages_take_layers_chunk_by_chunk():
    m = MegatronLayout(tensor_parallel=1, pipeline_parallel=2, virtual_pipeline=2)
    assert layer_stages(m, 8, where="x") == (0, 0, 1, 1, 0, 0, 1, 1)
    m = MegatronLayout(tensor_parallel=1, pipeline_parallel=2, virtual_pipeline=2,
                       stage_layers=(1, 2, 2, 0))
    assert layer_stages(m, 5, where="x") == (0, 1, 1, 0, 0)


# (model, layout, engine TP): dense, MoE and MLA models; TP into a finer and a coarser
# engine TP; PP even, uneven and interleaved; EP with and without expert TP and expert DP
PLANS = [
    ("tiny_llama", {"tensor_parallel": 2, "pipeline_parallel": 2}, 2),
    ("tiny_llama", {"tensor_parallel": 4, "pipeline_parallel": 1}, 2),
    ("tiny_llama", {"tensor_parallel": 1, "pipeline_parallel": 2, "virtual_pipeline": 1}, 4),
    ("tiny_moe", {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2,
                  "stage_layers": [2, 1]}, 2),
    ("tiny_moe", {"tensor_parallel": 2, "pipeline_parallel": 1, "expert_parallel": 2,
                  "expert_tensor_parallel": 2, "stage_layers": [3]}, 4),
    ("tiny_moe", {"tensor_parallel": 1, "pipeline_parallel": 2, "virtual_pipeline": 2,
                  "expert_parallel": 4, "stage_layers": [1, 1, 1, 0]}, 2),
    ("tiny_deepseek_v3", {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 1,
                          "stage_layers": [1, 2]}, 2),
    ("tiny_deepseek_v3", {"tensor_parallel": 4, "pipeline_parallel": 2, "expert_parallel": 4,
                          "stage_layers": [2, 1]}, 2),
]


@pytest.mark.parametrize(("model", "megatron", "engine_tp"), PLANS)
def test_small_plans_write_every_engine_byte_once_from_its_stage(tmp_path, model, megatron,
                                                                 engine_tp):
    data = copy.deepcopy(BASE)
    data["trainer"]["megatron"] = megatron
    data["inference"] |= {"gpus_per_replica": engine_tp, "tensor_parallel": engine_tp}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg, cl = load_model_config(MODELS / f"{model}.yaml"), load_cluster_config(path)
    tm = trainer_meta_from_config(cfg, cl)
    em = engine_metas_from_config(cfg, cl)
    plan = compute_plan(tm, em, cl, model=cfg)
    plan.validate()  # every destination byte written exactly once
    assert plan.bytes_total == cl.inference.replicas * sum(
        t.nbytes for e in em[:engine_tp] for t in e.tensors)
    m = cl.trainer.megatron
    stages = layer_stages(m, cfg.num_hidden_layers, where="")
    size = cl.trainer_world // m.pipeline_parallel
    for p in tm.params:
        if ".layers." in p.name:
            stage = stages[int(p.name.split(".")[2])]
        else:
            stage = 0 if "embed_tokens" in p.name else m.pipeline_parallel - 1
        assert {r // size for r in p.mesh.ranks} == {stage}, p.name
        want = m.expert_tensor_parallel if ".experts." in p.name else m.tensor_parallel
        assert p.mesh.shape[-1] == want, p.name
    # every task is sent by a rank of its parameter's mesh
    names = {p.name: p for p in tm.params}
    for rank in range(cl.trainer_world):
        for k in plan.task_piece[plan.trainer_ptr[rank]:plan.trainer_ptr[rank + 1]]:
            assert rank in names[plan.pieces[k].src_param].mesh.ranks


@pytest.mark.slow
def test_kimi_k2_from_the_megatron_layout_on_the_perplexity_cluster():
    """The prediction of docs/performance.md: structure, not timings."""
    cfg = load_model_config(MODELS / "kimi_k2.yaml")
    cl = load_cluster_config(ROOT / "configs/clusters/perplexity_kimi_k2_megatron.yaml")
    m = cl.trainer.megatron
    assert (m.tensor_parallel, m.pipeline_parallel, m.virtual_pipeline, m.expert_parallel) == (
        1, 16, 2, 16)
    tm = trainer_meta_from_config(cfg, cl)
    em = engine_metas_from_config(cfg, cl)
    plan = compute_plan(tm, em, cl, model=cfg)
    # dense parameters on the 16 stage meshes, then 16 x 16 one-rank expert meshes
    assert plan.num_groups == 2
    assert len(plan.send_nics) == 256 and len(plan.recv_nics) == 128
    assert plan.bytes_total == 8 * sum(t.nbytes for e in em[:16] for t in e.tensors)
    send = plan.send_bytes().sum(axis=0)
    assert send.min() > 0  # every trainer NIC sends
    r = simulate(plan, cl, nic_model="bound")
    assert r.binding == "write" and r.seconds > 0


def test_the_megatron_flag_lays_out_a_cluster_yamls_trainer():
    from actors.tools.cli.plan_cmd import with_megatron

    cl = load_cluster_config(ROOT / "configs/clusters/perplexity_kimi_k2.yaml")
    got = with_megatron(cl, "tp=8, pp=8,ep=32,etp=1,vpp=1,layers=7:8:8:8:8:8:8:6")
    m = got.trainer.megatron
    assert (m.tensor_parallel, m.pipeline_parallel, m.expert_parallel) == (8, 8, 32)
    assert m.stage_layers == (7, 8, 8, 8, 8, 8, 8, 6)
    assert got.sim.h2d_gbps is None and got.inference == cl.inference
    with pytest.raises(ValueError, match=r"perplexity_kimi_k2.yaml with --megatron 'tp=3'.*"
                                         r"3 x 1 = 3 does not divide the 256 trainer ranks"):
        with_megatron(cl, "tp=3")


@pytest.mark.parametrize(("flag", "needle"), [
    ("tp=8,pq=2", "'pq=2' is not KEY=VALUE with KEY one of tp, pp, ep, etp, vpp, layers"),
    ("tp=eight", "tp='eight' is not an integer"),
    ("tp=1,layers=1;2", "layers='1;2' is not integers separated by :"),
    ("pp=2", "tp=N is missing"),
])
def test_bad_megatron_flags_name_the_flag_and_item(flag, needle):
    from scheduling.cluster.megatron import parse_flag

    with pytest.raises(ValueError, match="--megatron") as err:
        parse_flag(flag)
    assert needle in str(err.value)


def test_the_plan_summary_names_the_trainer_layout():
    from actors.tools.cli.plan_cmd import trainer_layout

    assert trainer_layout(load_cluster_config(
        ROOT / "configs/clusters/perplexity_kimi_k2_megatron.yaml")) == (
        "megatron tp=1 pp=16 vpp=2 ep=16 etp=1 dp=16")
    assert trainer_layout(load_cluster_config(
        ROOT / "configs/clusters/perplexity_kimi_k2.yaml")) == "fsdp ep=8"


@pytest.mark.parametrize(("tp", "pp", "ep", "etp"), [(2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 4, 2)])
def test_meshes_are_the_live_sources(tp, pp, ep, etp):
    """What weight_transfer.sources.megatron builds from a live rank's TP/DP and expert
    TP/DP groups (Megatron's rank order), the config path builds from the layout."""
    from scheduling.cluster.megatron import dense_mesh, expert_mesh
    from weight_transfer.sources.megatron_layout import stage_mesh

    world = 8
    m = MegatronLayout(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                       expert_tensor_parallel=etp)
    size = world // pp
    for rank in range(world):
        base, local = divmod(rank, size)
        base *= size
        t, d = local % tp, local // tp
        live = stage_mesh(rank, [base + d * tp + i for i in range(tp)],
                          [base + j * tp + t for j in range(size // tp)])
        assert live == dense_mesh(m, world, rank // size)
        et, e, ed = local % etp, local // etp % ep, local // (etp * ep)
        live = stage_mesh(rank, [base + (ed * ep + e) * etp + i for i in range(etp)],
                          [base + (j * ep + e) * etp + et for j in range(size // (ep * etp))])
        assert live == expert_mesh(m, world, rank // size, e)
