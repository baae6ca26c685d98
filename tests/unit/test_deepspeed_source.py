"""The DeepSpeed source on a real tiny Llama whose parameters carry ZeRO-3's attributes.

No DeepSpeed here: each parameter gets what ``deepspeed.zero.Init`` leaves on it
(``ds_tensor``: this rank's padded flat slice, ``ds_shape``, ``ds_process_group``;
the parameter's own data emptied), or an engine stub answers its ZeRO stage. The
real engine runs in tests/integration/test_deepspeed_trainers.py. Every refusal names
the parameter, the rank and what is missing, and leaves the trainer unattached.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.trainer import TrainerMixin
from weight_transfer.layout.flat_blocks import FLAT
from weight_transfer.sender.flat_shard import FlatShard, flat_view
from weight_transfer.sources.registry import open_source, source_class
from weight_transfer.types import Placement

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=False)


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)


def partition(model: torch.nn.Module, *, rank: int, world: int = 2) -> dict[str, torch.Tensor]:
    """Give every parameter ZeRO-3's attributes as ``rank`` holds them; the full tensors."""
    full = {}
    for name, p in model.named_parameters():
        full[name] = p.data.clone()
        n = p.numel()
        size = -(-n // world)
        flat = torch.zeros(size * world, dtype=p.dtype)
        flat[:n] = p.data.reshape(-1)
        p.ds_shape, p.ds_numel, p.ds_process_group = p.shape, n, None
        p.ds_tensor = flat[rank * size : (rank + 1) * size].clone()
        p.data = torch.empty(0, dtype=p.dtype)
    return full


class Engine:
    """What the source reads of a ``DeepSpeedEngine``."""

    def __init__(self, module, stage, offload=None):
        self.module, self._stage, self._offload = module, stage, offload

    def zero_optimization_stage(self):
        return self._stage

    def zero_offload_param(self):
        return self._offload


class Offload:
    """What the source reads of ``engine.zero_offload_param()``."""

    def __init__(self, device: str) -> None:
        self.device = device


def test_zero3_parameters_are_flat_partitions_of_their_full_shape():
    model = llama()
    full = partition(model, rank=1)
    source = open_source(model, rank=1, world=2)
    assert source.name == "deepspeed" and source.stage == 3
    metas = {m.name: m for m in source.param_metas()}
    assert set(metas) == set(full)
    q = metas["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (64, 64) and q.placements == (FLAT,) and q.mesh.ranks == (0, 1)
    shard = source.tensors()["model.embed_tokens.weight"]
    assert isinstance(shard, FlatShard) and (shard.start, shard.valid) == (3200, 3200)
    assert torch.equal(shard.data, full["model.embed_tokens.weight"].reshape(-1)[3200:])
    # the engine itself is recognised too, and a plain module is FSDP2's
    assert open_source(Engine(model, 3), rank=1, world=2).name == "deepspeed"
    assert open_source(llama(), rank=0, world=2).name == "fsdp2"


def test_zero12_engine_is_a_replicated_source():
    source = open_source(Engine(llama(), 2), rank=0, world=2)
    metas = source.param_metas()
    assert {m.placements for m in metas} == {(Placement(kind="replicate"),)}
    assert {m.mesh.ranks for m in metas} == {(0, 1)}
    assert all(isinstance(t, torch.Tensor) for t in source.tensors().values())


def test_an_openrlhf_style_wrapper_is_described_by_the_model_inside():
    class Actor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = llama()

    actor = Actor()
    partition(actor, rank=0)
    source = open_source(Engine(actor, 3), rank=0, world=2)
    assert source.module is actor.model and source.prefix == "model."
    assert "lm_head.weight" in {m.name for m in source.param_metas()}


def refused(model, *, rank=1, world=2, source=None) -> str:
    trainer = TrainerMixin()
    with pytest.raises(ValueError) as err:
        trainer.wt_attach(model=model, rank=rank, world=world, source=source)
    assert trainer._wt_source is None and trainer._wt_model is None  # nothing attached
    return str(err.value)


def test_an_unknown_stage_is_refused():
    msg = refused(Engine(llama(), 4))
    assert "trainer rank 1" in msg and "ZeRO stage 4" in msg


def test_a_parameter_zero3_did_not_partition_is_refused():
    model = llama()
    partition(model, rank=1)
    del model.model.norm.weight.ds_tensor
    msg = refused(model)
    assert "'model.norm.weight'" in msg and "trainer rank 1" in msg and "no ds_tensor" in msg


def test_a_partition_of_another_size_is_refused():
    model = llama()
    partition(model, rank=1)
    p = model.model.layers[0].mlp.down_proj.weight
    p.ds_tensor = p.ds_tensor[:-1]
    msg = refused(model)
    assert "down_proj.weight" in msg and "4095 elements" in msg and "gives 4096" in msg


def test_partitions_under_a_lower_stage_are_refused():
    model = llama()
    partition(model, rank=0)
    msg = refused(Engine(model, 2), rank=0)
    assert "ZeRO-3 partitioned" in msg and "stage 2" in msg and "trainer rank 0" in msg


def test_a_parameter_no_name_table_maps_is_refused():
    model = llama()
    model.add_module("v_head", torch.nn.Linear(64, 1, bias=False).to(torch.bfloat16))
    partition(model, rank=1)
    msg = refused(model)
    assert "'v_head.weight'" in msg and "no destination in the llama name table" in msg
    assert "trainer rank 1" in msg


def test_parameters_swapped_to_nvme_are_refused():
    model = llama()
    partition(model, rank=0)
    assert "NVMe" in refused(Engine(model, 3, offload=Offload("nvme")), rank=0)


def test_partitions_offloaded_to_the_host_are_read_there():
    """offload_param cpu: each FlatShard is the partition in host memory, no copy; the h2d
    stage of a GPU trainer moves it whole (same geometry; here to the host again)."""
    model = llama()
    full = partition(model, rank=1)
    source = open_source(Engine(model, 3, offload=Offload("cpu")), rank=1, world=2)
    name = "model.layers.0.mlp.down_proj.weight"  # (64, 128): rank 1 holds rows 32-63
    shard = source.tensors()[name]
    assert shard.data.data_ptr() == model.get_parameter(name).ds_tensor.data_ptr()
    assert not shard.is_cuda
    moved = shard.to("cpu")
    assert (moved.shape, moved.start, moved.world, moved.valid) == ((64, 128), 4096, 2, 4096)
    assert torch.equal(flat_view(moved, ((32, 64), (0, 128))), full[name][32:])


def test_an_explicit_source_name_is_checked():
    with pytest.raises(ValueError, match="unknown trainer source 'colossalai'"):
        source_class("colossalai")
    assert "torch.nn.Module, not object" in refused(object(), source="deepspeed")


def _fake_groups(monkeypatch, *, rank: int, world: int, groups: dict[str, list[int]]):
    """torch.distributed as a ``world``-rank job at ``rank`` whose named groups hold these
    global ranks (no process group is formed)."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: groups[g])
    monkeypatch.setattr(dist, "get_group_rank", lambda g, r: groups[g].index(r))


def test_a_partition_over_a_subset_of_the_ranks_is_refused(monkeypatch):
    """MiCS (or a hierarchical partition): each parameter partitioned over 2 of 4 ranks."""
    model = llama()
    partition(model, rank=1)
    for p in model.parameters():
        p.ds_process_group = "mics-shard"
    _fake_groups(monkeypatch, rank=1, world=4, groups={"mics-shard": [0, 1]})
    msg = refused(model, world=4)
    assert "trainer rank 1" in msg and "'model.embed_tokens.weight'" in msg
    assert "partitioned over ranks [0, 1], not over every trainer rank 0..3" in msg
    assert "MiCS" in msg


def test_parameters_partitioned_over_different_groups_are_refused(monkeypatch):
    model = llama()
    partition(model, rank=1)
    for p in model.parameters():
        p.ds_process_group = "world"
    model.model.norm.weight.ds_process_group = "reversed"
    _fake_groups(monkeypatch, rank=1, world=2, groups={"world": [0, 1], "reversed": [1, 0]})
    msg = refused(model)
    assert "trainer rank 1" in msg and "'model.norm.weight'" in msg
    assert "partitioned over ranks [1, 0]" in msg and "partitioned the same way" in msg
