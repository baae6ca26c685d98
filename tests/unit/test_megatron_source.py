"""The Megatron-core source, pure and fast: its name table, its fused parts, whole plans.

No megatron here. Megatron's layouts are written plainly below from Hugging Face
tensors (:func:`to_megatron`: grouped QKV per query group, ``linear_fc1`` as each TP
rank's [gate; up], the vocabulary padded, TP cuts by ``torch.chunk``, pipeline stages
holding their layers under local indexes) and checked against what the source
describes (:mod:`weight_transfer.sources.megatron_layout`) and cuts
(:func:`weight_transfer.sources.megatron.cut_bands`); then whole plans of tiny_llama from
Megatron trainers (TP 1/2/4, PP 2) into reference engines at TP 1/2/3/4 (bf16, and FP8
at TP 1/2; a TP that does not divide the engine's is planned, not refused) run through
:class:`~weight_transfer.sender.executor.RankTransfer` from :class:`TpBlock` shards, byte
for byte against the reference loader. A stand-in GPTModel (its attributes only) checks
the live glue and the refusals at ``wt_attach``; the real model runs in
tests/integration/test_megatron_trainers.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from actors.tools.testkit.simnic_engines import SimnicEngines, one_replica_cluster
from actors.trainer import TrainerMixin
from scheduling import compute_plan
from scheduling.config_metadata import engine_metas_from_config
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.layout.shard_blocks import local_rect
from weight_transfer.model.arch.megatron_gpt import Fusion, map_megatron_name, part_bands
from weight_transfer.model.models import load_model_config
from weight_transfer.sources.megatron import MegatronSource, TpBlock, cut_bands
from weight_transfer.sources.megatron_layout import (
    LocalParam,
    MegatronDims,
    describe,
    stage_mesh,
)
from weight_transfer.sources.registry import open_source
from weight_transfer.types import MeshDesc, Placement, TrainerMeta

ROOT = Path(__file__).resolve().parents[2]
SHARD0, SHARD1 = Placement(kind="shard", dim=0), Placement(kind="shard", dim=1)
REPL = Placement(kind="replicate")

# ------------------------------------------------------------------ Megatron, written plainly

# Megatron's partition_dim per name suffix (None: not cut over TP)
PARTITION_DIM = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_proj.weight": 1,
                 "linear_fc1.weight": 0, "linear_fc2.weight": 1,
                 "word_embeddings.weight": 0, "output_layer.weight": 0}


def partition_dim(name: str) -> int | None:
    return next((d for s, d in PARTITION_DIM.items() if name.endswith(s)), None)


def fused_qkv(q, k, v, groups):
    """Megatron's linear_qkv of full q, k, v: per query group its q heads, its k, its v."""
    qs, ks, vs = q.chunk(groups), k.chunk(groups), v.chunk(groups)
    return torch.cat([t for g in range(groups) for t in (qs[g], ks[g], vs[g])])


def fused_fc1(gate, up, tp):
    """Megatron's linear_fc1 (full): each TP rank's gate rows, then its up rows."""
    return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True)])


def to_megatron(hf, *, layers, groups, vocab_rows):
    """Full Megatron tensors (local layer indexes) of the Hugging Face layers ``layers``."""
    out = {}
    for i, g in enumerate(layers):
        p, m = f"model.layers.{g}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = fused_qkv(
            *(hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"), groups)
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = (hf[p + "mlp.gate_proj.weight"],
                                            hf[p + "mlp.up_proj.weight"])
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    for name, hf_name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                          ("output_layer.weight", "lm_head.weight")):
        w = hf[hf_name]
        out[name] = torch.cat([w, torch.zeros(vocab_rows - w.shape[0], w.shape[1],
                                              dtype=w.dtype)])
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    return out


def tp_shard(name, full, tp, rank):
    if isinstance(full, tuple):  # gate, up: fused per rank
        return fused_fc1(*full, tp).chunk(tp)[rank]
    dim = partition_dim(name)
    return full if dim is None else full.chunk(tp, dim)[rank]


def local_params(shards):
    return [LocalParam(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                       tensor_parallel=partition_dim(n) is not None,
                       partition_dim=partition_dim(n)) for n, t in shards.items()]


# ------------------------------------------------------------------ the name table

NAMES = [
    ("embedding.word_embeddings.weight", {}, ("model.embed_tokens.weight",)),
    ("decoder.layers.1.self_attention.linear_qkv.weight", {1: 5},
     tuple(f"model.layers.5.self_attn.{x}_proj.weight" for x in "qkv")),
    ("decoder.layers.0.self_attention.linear_qkv.bias", {0: 0},
     tuple(f"model.layers.0.self_attn.{x}_proj.bias" for x in "qkv")),
    ("decoder.layers.0.mlp.linear_fc1.weight", {0: 3},
     ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight")),
    ("decoder.layers.0.mlp.linear_fc2.weight", {0: 3}, ("model.layers.3.mlp.down_proj.weight",)),
    ("decoder.layers.0.self_attention.linear_proj.weight", {0: 2},
     ("model.layers.2.self_attn.o_proj.weight",)),
    ("decoder.layers.0.self_attention.q_layernorm.weight", {0: 0},
     ("model.layers.0.self_attn.q_norm.weight",)),
    ("decoder.layers.0.pre_mlp_layernorm.weight", {0: 0},
     ("model.layers.0.post_attention_layernorm.weight",)),
    # Transformer Engine's spec: the norms fused into the next linear
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", {0: 4},
     ("model.layers.4.input_layernorm.weight",)),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", {0: 4},
     ("model.layers.4.post_attention_layernorm.weight",)),
    ("decoder.final_layernorm.weight", {}, ("model.norm.weight",)),
    ("output_layer.weight", {}, ("lm_head.weight",)),
    # no dense rule (megatron_moe maps experts), learned positions, a layer the stage lacks
    ("decoder.layers.0.mlp.experts.linear_fc1.weight0", {0: 0}, None),
    ("embedding.position_embeddings.weight", {}, None),
    ("decoder.layers.7.input_layernorm.weight", {0: 0}, None),
]


@pytest.mark.parametrize(("name", "layers", "want"), NAMES)
def test_name_table_maps_megatron_names_to_hugging_face_ones(name, layers, want):
    got = map_megatron_name(name, layers)
    assert (got and got[1]) == want


# (fusion, part, rows, groups, q per group) -> the part's row ranges of the shard
BANDS = [
    (Fusion.NONE, 0, 96, 1, 1, [(0, 96)]),
    (Fusion.GATE_UP, 0, 256, 1, 1, [(0, 128)]),
    (Fusion.GATE_UP, 1, 256, 1, 1, [(128, 256)]),
    (Fusion.QKV, 0, 64, 1, 2, [(0, 32)]),  # 1 group of 2 q heads (16 rows each), k, v
    (Fusion.QKV, 1, 64, 1, 2, [(32, 48)]),
    (Fusion.QKV, 2, 64, 1, 2, [(48, 64)]),
    (Fusion.QKV, 0, 128, 2, 2, [(0, 32), (64, 96)]),  # 2 groups: q of each
    (Fusion.QKV, 2, 128, 2, 2, [(48, 64), (112, 128)]),
    (Fusion.QKV, 1, 60, 2, 1, [(10, 20), (40, 50)]),  # MHA-like groups of 1 q head
]


@pytest.mark.parametrize(("fusion", "part", "rows", "groups", "qpg", "want"), BANDS)
def test_parts_are_bands_of_the_shard(fusion, part, rows, groups, qpg, want):
    bands = part_bands(fusion, part, rows=rows, groups=groups, q_per_group=qpg)
    assert bands.ranges() == want and bands.rows == sum(b - a for a, b in want)
    shard = torch.arange(rows * 3).reshape(rows, 3)
    assert torch.equal(cut_bands(shard, bands), torch.cat([shard[a:b] for a, b in want]))


def test_rows_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="do not split into 2 x 4"):
        part_bands(Fusion.QKV, 0, rows=100, groups=2, q_per_group=2)


# (heads, query groups, TP): every rank's q, k, v are its Shard(0) blocks of HF's
QKV_CASES = [(4, 2, 1), (4, 2, 2), (8, 4, 2), (8, 4, 4), (8, 2, 2), (4, 4, 4), (6, 3, 3),
             (8, 8, 2)]


@pytest.mark.parametrize(("heads", "groups", "tp"), QKV_CASES)
def test_grouped_qkv_shards_are_the_hugging_face_blocks(heads, groups, tp):
    hd, h = 4, 8
    hf = {x: torch.randn(n * hd, h) for x, n in (("q", heads), ("k", groups), ("v", groups))}
    hf_bias = {x: torch.randn(t.shape[0]) for x, t in hf.items()}
    full, full_bias = fused_qkv(*hf.values(), groups), fused_qkv(*hf_bias.values(), groups)
    dims = MegatronDims(tp=tp, heads=heads, query_groups=groups)
    mesh = MeshDesc(ranks=tuple(range(tp)), shape=(1, tp))
    for rank in range(tp):
        shards = {"decoder.layers.0.self_attention.linear_qkv.weight": full.chunk(tp)[rank],
                  "decoder.layers.0.self_attention.linear_qkv.bias": full_bias.chunk(tp)[rank]}
        parts = describe(local_params(shards), dims=dims, mesh=mesh, global_layer={0: 0},
                         where="test")
        for part, want in zip(parts, [*hf.values(), *hf_bias.values()], strict=True):
            assert part.meta.shape == tuple(want.shape)
            assert part.meta.placements == (REPL, SHARD0) and part.dim == 0
            block = local_rect(part.meta, rank)
            got = cut_bands(shards[part.source], part.bands)
            assert torch.equal(got, want[tuple(slice(a, b) for a, b in block)])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fc1_shards_are_gate_and_up_blocks_and_vocab_stays_padded(tp):
    gate, up, emb = torch.randn(64, 8), torch.randn(64, 8), torch.randn(1000, 8)
    padded = torch.cat([emb, torch.zeros(24, 8)])  # 1000 padded to 1024
    dims = MegatronDims(tp=tp, heads=4, query_groups=4)
    mesh = MeshDesc(ranks=tuple(range(tp)), shape=(1, tp))
    for rank in range(tp):
        shards = {"decoder.layers.0.mlp.linear_fc1.weight": fused_fc1(gate, up, tp).chunk(tp)[rank],
                  "embedding.word_embeddings.weight": padded.chunk(tp)[rank]}
        g, u, e = describe(local_params(shards), dims=dims, mesh=mesh, global_layer={0: 0},
                           where="test")
        assert [p.meta.name for p in (g, u, e)] == [
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.embed_tokens.weight"]
        assert e.meta.shape == (1024, 8)  # padded: the plan reads the first 1000 rows
        for part, want in ((g, gate), (u, up), (e, padded)):
            block = local_rect(part.meta, rank)
            assert torch.equal(cut_bands(shards[part.source], part.bands),
                               want[tuple(slice(a, b) for a, b in block)])


# (rank, TP group, DP group) -> the stage's (dp, tp) mesh; Megatron's order tp-dp-pp
MESHES = [
    (0, (0,), (0,), (0,), (1, 1)),
    (1, (0, 1), (1,), (0, 1), (1, 2)),
    (3, (2, 3), (1, 3), (0, 1, 2, 3), (2, 2)),  # TP2 x DP2
    (5, (4, 5), (5,), (4, 5), (1, 2)),  # stage 2 of TP2 x PP3
    (6, (6, 7), (2, 6), (2, 3, 6, 7), (2, 2)),  # TP2 x DP2 x PP2: stage 1 of ranks 2,3,6,7?
]


@pytest.mark.parametrize(("rank", "tp", "dp", "ranks", "shape"), MESHES)
def test_stage_mesh_is_the_rank_grid(rank, tp, dp, ranks, shape):
    mesh = stage_mesh(rank, tp, dp)
    assert (mesh.ranks, mesh.shape, mesh.dim_names) == (ranks, shape, ("dp", "tp"))


def test_groups_that_are_no_grid_are_refused():
    with pytest.raises(ValueError, match="not in its own TP group"):
        stage_mesh(2, (0, 1), (2,))
    with pytest.raises(ValueError, match="do not form a rank grid"):
        stage_mesh(0, (0, 1), (0, 1))


DIMS2 = MegatronDims(tp=2, heads=4, query_groups=2)
MESH2 = MeshDesc(ranks=(0, 1), shape=(1, 2))
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
REFUSED = [
    (LocalParam(name=QKV, shape=(64, 8), dtype="bfloat16"), DIMS2, "has no partition_dim"),
    (LocalParam(name=QKV, shape=(64, 8), dtype="bfloat16", tensor_parallel=True,
                partition_dim=1), DIMS2, "partition_dim 1, the Megatron name table says 0"),
    (LocalParam(name="decoder.final_layernorm.weight", shape=(8,), dtype="bfloat16",
                tensor_parallel=True, partition_dim=0), DIMS2, "holds it whole"),
    (LocalParam(name="decoder.layers.0.mlp.shared_experts.linear_fc1.weight", shape=(4, 8),
                dtype="bfloat16"),
     DIMS2, "'decoder.layers.0.mlp.shared_experts.linear_fc1.weight' has no destination"),
    (LocalParam(name=QKV, shape=(64, 8), dtype="bfloat16", tensor_parallel=True,
                partition_dim=0), MegatronDims(tp=2, heads=3, query_groups=3),
     "TP the groups"),
    (LocalParam(name=QKV, shape=(62, 8), dtype="bfloat16", tensor_parallel=True,
                partition_dim=0), DIMS2, "local shape"),
]


@pytest.mark.parametrize(("param", "dims", "words"), REFUSED)
def test_bad_parameters_are_refused_naming_parameter_and_rank(param, dims, words):
    with pytest.raises(ValueError, match="trainer rank 1") as err:
        describe([param], dims=dims, mesh=MESH2, global_layer={0: 0}, where="trainer rank 1")
    assert words in str(err.value)


def test_tied_output_layer_is_not_sent_and_one_name_twice_is_refused():
    tied = dataclasses.replace(DIMS2, tied=True)
    out = LocalParam(name="output_layer.weight", shape=(512, 8), dtype="bfloat16",
                     tensor_parallel=True, partition_dim=0)
    assert describe([out], dims=tied, mesh=MESH2, global_layer={}, where="r") == []
    norms = [LocalParam(name=f"decoder.layers.{i}.input_layernorm.weight", shape=(8,),
                        dtype="bfloat16") for i in (0, 1)]
    with pytest.raises(ValueError, match="both hold Hugging Face parameter"):
        describe(norms, dims=DIMS2, mesh=MESH2, global_layer={0: 3, 1: 3}, where="r")


# ------------------------------------------------------------------ whole plans of tiny_llama


def megatron_ranks(cfg, hf, tp, pp, vocab_rows):
    """Per trainer rank (Megatron's order: TP innermost, then PP): its metadata and the
    blocks its source would read (a TpBlock of each part; ``group`` None: gathers here
    are full tensors, the TP gather runs in the integration test)."""
    per_stage = cfg.num_hidden_layers // pp
    dims = MegatronDims(tp=tp, heads=cfg.num_attention_heads, query_groups=cfg.kv_heads)
    out = []
    for rank in range(tp * pp):
        stage, t = divmod(rank, tp)
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        full = to_megatron(hf, layers=layers, groups=cfg.kv_heads, vocab_rows=vocab_rows)
        keep = {n for n in full if n.startswith("decoder.layers")}
        keep |= {"embedding.word_embeddings.weight"} if stage == 0 else set()
        keep |= {"decoder.final_layernorm.weight", "output_layer.weight"} if stage == pp - 1 \
            else set()
        shards = {n: tp_shard(n, full[n], tp, t) for n in full if n in keep}
        mesh = stage_mesh(rank, tuple(range(stage * tp, (stage + 1) * tp)), (rank,))
        parts = describe(local_params(shards), dims=dims, mesh=mesh,
                         global_layer=dict(enumerate(layers)), where=f"trainer rank {rank}")
        blocks = {p.meta.name: TpBlock(data=shards[p.source], bands=p.bands, shape=p.meta.shape,
                                       dim=p.dim, group=None, world=tp) for p in parts}
        out.append(([p.meta for p in parts], blocks))
    return out


def padded_state(hf, rows):
    return {n: torch.cat([t, torch.zeros(rows - t.shape[0], t.shape[1], dtype=t.dtype)])
            if n in ("model.embed_tokens.weight", "lm_head.weight") else t
            for n, t in hf.items()}


# (trainer TP, PP, engine TP): shard-direct where blocks cover, cut or gathered elsewhere;
# TP 4 needs 4 query groups (Megatron cuts by whole groups): tiny_llama with 4 kv heads;
# TPs that do not divide each other (2 and 3) need 6 heads: the engine's blocks are cut
# where the trainer's meet, nothing is refused
PLANS = [(1, 1, 2, False), (2, 1, 1, False), (2, 1, 2, False), (2, 1, 4, False),
         (4, 1, 2, False), (2, 2, 2, False), (1, 2, 1, False), (2, 1, 3, False),
         (2, 1, 2, True), (2, 1, 1, True)]  # FP8 engines: 128-row blocks inside a shard
SHAPES = {4: {"num_key_value_heads": 4},
          3: {"num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 768,
              "vocab_size": 1152}}


@pytest.mark.parametrize(("tp", "pp", "engine_tp", "fp8"), PLANS)
def test_megatron_shards_land_the_reference_bytes(tp, pp, engine_tp, fp8):
    cfg = load_model_config(ROOT / "configs" / "models" / "tiny_llama.yaml")
    cfg = cfg.model_copy(update=SHAPES.get(max(tp, engine_tp), {}))
    cl = one_replica_cluster(trainer_ranks=tp * pp, tp=engine_tp, fp8=fp8)
    hf = random_state_dict(cfg, seed=11)
    vocab_rows = -(-cfg.vocab_size // (128 * tp)) * 128 * tp  # as Megatron-LM pads it
    ranks = megatron_ranks(cfg, hf, tp, pp, vocab_rows)
    metas = {m.name: m for ms, _ in ranks for m in ms}
    assert all(m == metas[m.name] for ms, _ in ranks for m in ms)  # ranks agree
    assert set(metas) == set(hf)
    tm = TrainerMeta(params=tuple(metas.values()), ranks=cl.rank_infos())
    full = padded_state(hf, vocab_rows)
    with SimnicEngines(engine_metas_from_config(cfg, cl, fp8=fp8)) as eng:
        plan = compute_plan(tm, eng.engines, cl, model=cfg, fp8=fp8)
        plan.validate()
        direct = {tm.params[i].name for i in plan.direct_params}
        if engine_tp % tp == 0:  # every engine shard inside one trainer block: none gathered
            assert direct == set(metas)
        for rank, (_, blocks) in enumerate(ranks):
            # a gathered parameter whole (one process: no TP group to gather over)
            local = {n: b if n in direct else full[n] for n, b in blocks.items()}
            report = eng.run(plan, tm.params, rank, local.__getitem__)
            assert report.bytes_written == report.bytes_planned
        assert eng.mismatches(cfg, hf, fp8=fp8) == []


# ------------------------------------------------------------------ the live glue


class Layer(torch.nn.Module):
    def __init__(self, number, h, qkv_rows):
        super().__init__()
        self.layer_number = number
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.randn(h))
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = torch.nn.Linear(h, qkv_rows, bias=False)


class FakeGPT(torch.nn.Module):
    """What the source reads of a GPTModel: config, decoder layers and their numbers."""

    def __init__(self, *, first_layer=1, tp=1):
        super().__init__()
        self.config = SimpleNamespace(tensor_model_parallel_size=tp, num_attention_heads=4,
                                      num_query_groups=2)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([Layer(first_layer, 8, 2 * 4 * 4)])  # head dim 4
        qkv = self.decoder.layers[0].self_attention.linear_qkv.weight
        qkv.tensor_model_parallel, qkv.partition_dim = True, 0


class Wrapper(torch.nn.Module):  # Megatron's DDP / Float16Module keep the model in .module
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_a_gpt_model_is_recognised_through_its_wrappers_and_described_live():
    chunks = [Wrapper(FakeGPT(first_layer=1)), Wrapper(Wrapper(FakeGPT(first_layer=3)))]
    source = open_source(chunks, rank=0, world=1)  # virtual pipeline chunks
    assert isinstance(source, MegatronSource) and source.name == "megatron"
    metas = {m.name: m for m in source.param_metas()}
    assert set(metas) == {f"model.layers.{i}.{n}" for i in (0, 2) for n in (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight")}
    q = metas["model.layers.2.self_attn.q_proj.weight"]
    assert q.shape == (16, 8) and q.mesh.shape == (1, 1) and q.placements == (REPL, SHARD0)
    live = chunks[1].module.module.decoder.layers[0].self_attention.linear_qkv.weight
    block = source.tensors()["model.layers.2.self_attn.k_proj.weight"]
    assert isinstance(block, TpBlock)
    assert torch.equal(block.full_tensor(), torch.cat([live[8:12], live[24:28]]))
    assert torch.equal(source.full_state()["model.layers.0.input_layernorm.weight"],
                       source.module.decoder.layers[0].input_layernorm.weight)
    assert open_source(torch.nn.Linear(2, 2), rank=0, world=1).name == "fsdp2"
    with pytest.raises(ValueError, match="no trainer source recognises a list"):
        open_source([torch.nn.Linear(2, 2)], rank=0, world=1)


class Trainer(TrainerMixin):
    pass


def test_attach_refuses_what_the_source_cannot_describe_and_attaches_nothing():
    bad = FakeGPT()
    bad.embedding = torch.nn.Module()
    bad.embedding.position_embeddings = torch.nn.Embedding(4, 8)
    trainer = Trainer()
    with pytest.raises(ValueError, match=r"trainer rank 0 \(megatron source\): parameter "
                                         r"'embedding.position_embeddings.weight' has no "
                                         "destination"):
        trainer.wt_attach(model=bad, rank=0, world=1)
    with pytest.raises(RuntimeError, match="call wt_attach"):
        trainer.wt_param_metas()
    with pytest.raises(ValueError, match="TP group of a model of TP 2 on 2 trainer ranks"):
        MegatronSource(FakeGPT(tp=2), rank=0, world=2)
