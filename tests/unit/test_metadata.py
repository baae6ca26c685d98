"""Metadata from live modules: FSDP2 DTensors (one process, fake process group), EP meshes."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from weight_transfer.layout.engine_layout import check_mapping
from weight_transfer.model.live_metadata import engine_tensors_from_state, param_metas_from_module
from weight_transfer.model.models import load_model_config, trainer_param_specs
from weight_transfer.types import MeshDesc, Placement

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def module_from_specs(specs, device="cpu") -> torch.nn.Module:
    """An nn.Module tree whose parameter names are the specs' (HF) names."""
    root = torch.nn.Module()
    for s in specs:
        *path, leaf = s.name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        data = torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=device)
        mod.register_parameter(leaf, torch.nn.Parameter(data))
    return root


@pytest.fixture
def world_of_4():
    """This process is rank 1 of 4 (fake backend: collectives do nothing, metadata is real)."""
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_hsdp_parameters(world_of_4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = load_model_config(CONFIGS / "tiny_llama.yaml")
    specs = trainer_param_specs(cfg)
    model = module_from_specs(specs)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    metas = param_metas_from_module(model, rank_of_mesh=lambda r: r + 10)
    assert [(m.name, m.shape, m.dtype) for m in metas] == [(s.name, s.shape, s.dtype)
                                                            for s in specs]
    q = next(m for m in metas if m.name == "model.layers.1.self_attn.q_proj.weight")
    assert q.mesh == MeshDesc(ranks=(10, 11, 12, 13), shape=(2, 2),
                              dim_names=("replicate", "shard"))
    assert q.placements == (Placement(kind="replicate"), Placement(kind="shard", dim=0))
    check_mapping(cfg, fp8=True, expert_naming="per_expert",
                  trainer_names=[m.name for m in metas], tp_size=2, ep_size=1)


def test_expert_parallel_submesh_and_plain_buffers(world_of_4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    experts = torch.nn.Module()
    local = torch.zeros(4, 16, 8, dtype=torch.bfloat16)  # 4 of 8 experts on this EP rank
    dt = DTensor.from_local(local, mesh["ep"], [Shard(0)], run_check=False)
    experts.gate_up_proj = torch.nn.Parameter(dt)
    experts.register_buffer("e_score_correction_bias", torch.zeros(8))
    (gate_up, bias) = param_metas_from_module(experts)
    assert gate_up.shape == (8, 16, 8) and gate_up.dtype == "bfloat16"
    assert gate_up.mesh == MeshDesc(ranks=(0, 1), shape=(2,), dim_names=("ep",))  # row of rank 1
    assert gate_up.placements == (Placement(kind="shard", dim=0),)
    assert bias.mesh.ranks == (0, 1, 2, 3) and bias.placements == (Placement(kind="replicate"),)
    (_, bias2) = param_metas_from_module(experts, replicated_ranks=[1, 3])
    assert bias2.mesh == MeshDesc(ranks=(1, 3), shape=(2,))


def test_tied_alias_once_and_wrapper_prefixes_stripped_without_process_group():
    inner = torch.nn.Module()
    inner.embed = torch.nn.Embedding(10, 4)
    inner.head = torch.nn.Linear(4, 10, bias=False)
    inner.head.weight = inner.embed.weight
    outer = torch.nn.Module()
    outer._orig_mod = inner
    metas = param_metas_from_module(outer)
    assert [m.name for m in metas] == ["embed.weight"]
    assert metas[0].mesh == MeshDesc(ranks=(0,), shape=(1,))


def test_meta_device_model_needs_no_memory():
    cfg = load_model_config(CONFIGS / "deepseek_v3.yaml")
    specs = [s for s in trainer_param_specs(cfg, expert_naming="stacked") if s.layer in (None, 3)]
    metas = param_metas_from_module(module_from_specs(specs, device="meta"))
    assert [(m.name, m.shape) for m in metas] == [(s.name, s.shape) for s in specs]


def test_engine_tensors_from_state():
    embed = torch.zeros(64, 8, dtype=torch.bfloat16)
    state = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed.detach(),  # vLLM ties the head to the embedding
        "model.layers.0.mlp.gate_up_proj.weight": torch.zeros(4, 8, dtype=torch.float8_e4m3fn),
        "model.layers.0.mlp.gate_up_proj.weight_scale_inv": torch.ones(1, 1),
        "model.norm.weight": embed[0],  # a view that is not the same tensor
    }
    specs = engine_tensors_from_state(state)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        ("model.embed_tokens.weight", (64, 8), "bfloat16"),
        ("model.layers.0.mlp.gate_up_proj.weight", (4, 8), "float8_e4m3fn"),
        ("model.layers.0.mlp.gate_up_proj.weight_scale_inv", (1, 1), "float32"),
        ("model.norm.weight", (8,), "bfloat16"),
    ]
    with pytest.raises(ValueError, match="'x' is a list"):
        engine_tensors_from_state({"x": [1]})


def test_one_tensor_record_for_every_kind_of_metadata():
    import dataclasses
    import pickle

    from weight_transfer.engines.reference.buffer import TensorSlot
    from weight_transfer.model.models import TrainerParamSpec
    from weight_transfer.types import EngineTensorMeta, ParamMeta, RegionDesc, TensorSpec

    mesh = MeshDesc(ranks=(0, 1), shape=(2,))
    region = RegionDesc(owner="e/tp0", nic="n0", addr=0, length=64, rkey=1)
    records = [
        TensorSpec(name="w", shape=(4, 8), dtype="bfloat16"),
        ParamMeta(name="w", shape=(4, 8), dtype="bfloat16", mesh=mesh),
        EngineTensorMeta(name="w", shape=(4, 8), dtype="bfloat16", region=region, offset=0),
        TensorSlot(name="w", shape=(4, 8), dtype="bfloat16", offset=128),
        TrainerParamSpec(name="w", shape=(4, 8), dtype="bfloat16", expert=1, layer=2),
    ]
    for r in records:
        assert isinstance(r, TensorSpec) and r.nbytes == 64
        assert not hasattr(r, "__dict__")  # slotted all the way down
        assert pickle.loads(pickle.dumps(r)) == r
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.name = "x"
    assert ParamMeta(name="w", shape=(3,), dtype="float32", mesh=mesh).placements == ()
    assert records[0] != records[1]  # a ParamMeta is not equal to its bare spec
    with pytest.raises(TypeError):
        TensorSpec("w", (1,), "float32")  # keyword arguments only
    assert engine_tensors_from_state({"x": torch.zeros(2, dtype=torch.float16)}) == [
        TensorSpec(name="x", shape=(2,), dtype="float16")]
