"""Real Megatron-core trainers as the source: 2 gloo ranks on CPU -> reference engines, vLLM.

The trainer actor is docs/embedding.md's ``megatron-trainer`` snippet as written (a
``GPTModel`` of tiny_llama's shape with the local layer spec, bf16, its vocabulary of
1000 padded to 1024 as Megatron-LM pads it), with a train step and the oracle added by
subclassing; Megatron's CUDA assumptions are side-stepped by the test kit
(:mod:`actors.tools.testkit.megatron_cpu`). The oracle is :func:`hf_from_megatron`: the
weights Megatron holds, gathered over TP by the test and converted to a Hugging Face
state dict plainly (grouped QKV split per query group, each rank's [gate; up] split, the
padding dropped), independent of the plan. After a real optimizer step and an update,
every byte of the TP=1 engine and of the TP=2 engine equals the reference loader's
layout of that state dict. At TP=2 into TP=2 every shard is written by its own rank with
no collective, also into an FP8 engine at TP=2 (each rank quantizes its own shards'
blocks; weights and scales equal the reference quantization). Four more ranks at TP=2 x
PP=2 (each stage one mesh, the names of stage 1 made global) write into the TP=2
engine, each its own shards of its own stage's layers. Two more at EP=2 (tiny_moe, a
Qwen3-MoE: megatron-core's MoE layers with local experts and the allgather dispatcher
run on CPU) each write their own 4 of the 8 experts of each MoE layer, under the model's
expert indexes, into a TP=1 reference engine of tiny_moe, and the same pair into a real
vLLM of tiny_moe at TP=1 (float32; vLLM's fused experts ``w13``/``w2`` per layer): nothing
gathered, every registered byte equal to vLLM's own ``load_weights`` of the conversion.

Into a real vLLM (one replica at TP=2 in float32, started by the test that uses it and
stopped after it), after a real step and an update from the TP=2 trainers: each rank
writes its own shards into the vLLM worker of its TP coordinate with no collective;
every byte registered in both workers equals vLLM's own ``load_weights`` of the oracle's
state dict saved as a Hugging Face checkpoint; and, black-box, vLLM's greedy tokens are
the argmax of Megatron's own forward (a float32 ``GPTModel`` holding the trainers'
weights, over the prompt and vLLM's tokens) at every step, their log-probabilities
Megatron's within 1e-4. vLLM at TP=1 is covered from FSDP2 by the vLLM modules and, for
Megatron's layouts into a TP=1 engine (the row-parallel gathers), by the reference
engine at TP=1 here.

One fleet for the module: the two TP=2 trainer actors, one TP=1 replica and one TP=2
replica of the reference engine, each with its own controller over the same trainers
(the vLLM replicas and the TP=2 x PP=2 ranks start in their tests; the EP=2 pair once
for its two tests).
``wt demo --trainer megatron`` and ``wt bench designs --trainer megatron`` (ours beside
slime's own sync) run as smoke runs on a fleet of their own, the demo's smallest shape.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import ray
import torch

from actors import WeightTransferController
from actors.tools.testkit.doc_snippets import run_snippet
from actors.tools.testkit.engine_bytes import engine_mismatches
from actors.tools.testkit.megatron_hf import hf_from_megatron
from actors.tools.testkit.source_fleet import (
    fp8_update,
    free_port,
    kill,
    reference_engines,
    start_trainers,
)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "embedding.md"
MODEL = ROOT / "configs" / "models" / "tiny_llama.yaml"
MOE = ROOT / "configs" / "models" / "tiny_moe.yaml"  # Qwen3-MoE: layer 0 dense, 8 experts
VOCAB_ROWS = 1024  # tiny_llama's 1000, padded to a multiple of 128 x TP
ROW_PARALLEL_BYTES = 2 * 2 * 256 * 512 * 2  # o_proj and down_proj of 2 layers, bf16
NORM_BYTES = 5 * 256 * 4  # the replicated RMSNorm weights a vLLM rank holds, float32

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (scripts/setup.sh installs it)"),
]
ENV = {"OMP_NUM_THREADS": "1"}
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors take our classes


def make_model(model_file=MODEL):
    from actors.tools.testkit.megatron_cpu import gpt_model
    from weight_transfer.model.models import load_model_config

    torch.manual_seed(0)  # every rank cuts its shard from the same full weights
    return gpt_model(load_model_config(model_file), vocab_rows=VOCAB_ROWS)


# ------------------------------------------------------------------ the oracle, plainly

def first_expert(model):
    """The model's index of this rank's local expert 0 (apart from the actor class: a method
    reading ``.config`` beside ``torch.distributed`` makes cloudpickle take the module
    ``torch.distributed.config`` along, which does not pickle)."""
    from megatron.core import parallel_state as ps

    per_rank = (model.config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * per_rank


def trainer_class():
    """The snippet's actor class, with what the test needs of it."""
    snippet = run_snippet(DOC, "megatron-trainer", {})["MegatronTrainer"]

    class TestTrainer(snippet.__ray_metadata__.modified_class):
        def __init__(self, rank, world, port, tp, pp, ep=1, model_file=MODEL):
            from actors.tools.testkit.megatron_cpu import patch_for_cpu

            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            patch_for_cpu()
            super().__init__(rank, world, functools.partial(make_model, model_file), tp=tp,
                             pp=pp, ep=ep, backend="gloo")
            self.tp, self.optimizer = tp, torch.optim.Adam(self.model.parameters(), lr=1e-2)

        def train_step(self, seed: int) -> float:
            """A real step at PP=1; under PP every weight moves by a seeded amount."""
            from actors.tools.testkit.megatron_cpu import causal_mask, positions

            gen = torch.Generator().manual_seed(seed)
            if not (self.model.pre_process and self.model.post_process):
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen).to(p.dtype), alpha=0.01)
                return 0.0
            tokens = torch.randint(0, 1000, (1, 16), generator=gen)
            loss = self.model(tokens, positions(tokens), causal_mask(tokens),
                              labels=torch.roll(tokens, -1, 1)).float().mean()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            return float(loss.detach())

        def megatron_state(self):
            """Every parameter of this stage gathered over TP (an MoE expert's over expert
            TP) by the test; TP rank 0 answers, with the stage's global layer indexes and
            the model's index of its local expert 0; every rank calls."""
            from megatron.core import parallel_state as ps

            full = {}
            for name, p in self.model.named_parameters():
                expert = ".mlp.experts." in name
                group = (ps.get_expert_tensor_parallel_group() if expert
                         else ps.get_tensor_model_parallel_group())
                world = torch.distributed.get_world_size(group)
                t = p.detach().contiguous()
                if getattr(p, "tensor_model_parallel", False) and world > 1:
                    parts = [torch.empty_like(t) for _ in range(world)]
                    torch.distributed.all_gather(parts, t, group=group)
                    t = torch.cat(parts, dim=p.partition_dim)
                full[name] = t.clone()
            layers = {i: n.layer_number - 1 for i, n in enumerate(self.model.decoder.layers)}
            first = first_expert(self.model)
            return (full, layers, first) if ps.get_tensor_model_parallel_rank() == 0 else None

        def megatron_logprobs(self, tokens: list[int]) -> torch.Tensor | None:
            """Megatron's own forward over ``tokens`` in float32 (a float32 GPTModel holding
            this one's weights): each position's next-token log-probabilities over the
            Hugging Face vocabulary; TP rank 0 answers, every rank calls (PP=1)."""
            from megatron.core import parallel_state as ps

            from actors.tools.testkit.megatron_cpu import causal_mask, gpt_model, positions
            from weight_transfer.model.models import load_model_config

            cfg = load_model_config(MODEL)
            model = gpt_model(cfg, vocab_rows=VOCAB_ROWS, dtype=torch.float32)
            with torch.no_grad():
                for (n32, p32), (n, p) in zip(model.named_parameters(),
                                              self.model.named_parameters(), strict=True):
                    assert n32 == n, (n32, n)
                    p32.copy_(p)
                x = torch.tensor([tokens])
                logits = model(x, positions(x), causal_mask(x))[0]  # [s, this rank's vocab]
            parts = [torch.empty_like(logits) for _ in range(self.tp)]
            torch.distributed.all_gather(parts, logits.contiguous(),
                                         group=ps.get_tensor_model_parallel_group())
            full = torch.cat(parts, dim=-1)[:, : cfg.vocab_size]
            return torch.log_softmax(full, dim=-1) if ps.get_tensor_model_parallel_rank() == 0 \
                else None

    return ray.remote(TestTrainer)


def hf_state(trainers, cfg, tp):
    """The oracle's Hugging Face state dict of every stage's (and EP rank's) weights; what
    several ranks hold (replicated over data parallel) must be equal."""
    out = {}
    for got in ray.get([t.megatron_state.remote() for t in trainers]):
        if got is not None:
            for n, t in hf_from_megatron(*got, tp=tp, heads=cfg.num_attention_heads,
                                         groups=cfg.kv_heads, vocab=cfg.vocab_size).items():
                assert n not in out or torch.equal(out[n], t), f"data-parallel ranks differ: {n}"
                out[n] = t
    return out


def save_hf(state, model_cfg, path):
    """The oracle's state dict as a float32 Hugging Face checkpoint at ``path`` (every name
    and shape checked by ``load_state_dict``): what vLLM's own load_weights reads."""
    from weight_transfer.engines.reference.hf_model import build_hf_model

    model = build_hf_model(model_cfg, seed=0, dtype=torch.float32)
    model.load_state_dict({n: t.float() for n, t in state.items()})
    model.save_pretrained(path)
    return path


def start(cls, *, tp, pp, dp=1, ep=1, model_file=MODEL):
    port, world = free_port(), tp * pp * dp  # EP splits the data-parallel ranks
    return start_trainers(cls, [(r, world, port, tp, pp, ep, model_file) for r in range(world)],
                          env=ENV)


@pytest.fixture(scope="module")
def fleet(ray_job):
    cls = trainer_class()
    with reference_engines(MODEL, update_timeout_s=120, barrier_timeout_s=60) as (configs,
                                                                                   engines):
        trainers = start(cls, tp=2, pp=1)
        try:
            yield cls, configs, trainers, engines
        finally:
            kill(trainers)


@pytest.mark.parametrize("tp", [1, 2])
def test_engines_hold_the_weights_megatron_holds(fleet, tp):
    _, configs, trainers, engines = fleet
    cfg, replicas = configs[tp], engines[tp]
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    summary = ctl.setup()
    # TP=2 into TP=2: every shard by its own rank; into TP=1 the row-parallel o_proj and
    # down_proj (whose ranks' blocks would cut every row in two) are gathered over TP
    assert summary.gathered_bytes == {1: ROW_PARALLEL_BYTES, 2: 0}[tp]
    assert summary.gathered_params == {1: 4, 2: 0}[tp]
    assert all(n > 0 for n in summary.bytes_by_rank.values())  # both ranks write
    before = hf_state(trainers, cfg.model, 2)
    losses = ray.get([t.train_step.remote(tp) for t in trainers])
    assert len(set(losses)) == 1 and losses[0] > 0
    report = ctl.update(version=tp)
    assert report.bytes == summary.bytes_total
    assert ctl.weights_version() == {"engine0": tp}
    after = hf_state(trainers, cfg.model, 2)
    assert engine_mismatches(cfg.model, trainers, replicas, state=after) == []
    assert any(not torch.equal(before[n], after[n]) for n in after)  # the step moved them


def test_fp8_engines_hold_the_reference_quantization_of_megatron_weights(fleet):
    """The TP=2 ranks into an FP8 replica at TP=2 (128x128 blocks, one scale per block):
    each rank quantizes the blocks of the shards it holds, with no collective, and after a
    real step every engine byte, weights and scales, equals the reference quantization of
    the oracle's state dict."""
    _, configs, trainers, _ = fleet
    with fp8_update(configs[2], trainers, version=20) as (summary, replicas):
        assert summary.gathered_bytes == 0 and min(summary.bytes_by_rank.values()) > 0
        state = hf_state(trainers, configs[2].model, 2)
        assert engine_mismatches(configs[2].model, trainers, replicas, fp8=True,
                                 state=state) == []


def test_pipeline_stages_write_their_own_layers(fleet):
    """TP=2 x PP=2 on 4 ranks (Megatron's order: ranks 0-1 stage 0, 2-3 stage 1) into the
    TP=2 reference engine: each stage's ranks write their own layers, each its own shards,
    with no collective (the cluster derived from the 4 actors)."""
    cls, configs, _, engines = fleet
    cfg, replicas = configs[2].replace(cluster=None), engines[2]
    trainers = start(cls, tp=2, pp=2)
    try:
        metas = ray.get([t.wt_param_metas.remote() for t in trainers])
        assert [sorted({m.name.split(".")[2] for m in rank.params if ".layers." in m.name})
                for rank in metas] == [["0"], ["0"], ["1"], ["1"]]  # stage 1's 0 is the 1
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        summary = ctl.setup()
        assert summary.gathered_bytes == 0 and min(summary.bytes_by_rank.values()) > 0
        ray.get([t.train_step.remote(3) for t in trainers])
        ctl.update(version=7)
        state = hf_state(trainers, cfg.model, 2)
        assert engine_mismatches(cfg.model, trainers, replicas, state=state) == []
    finally:
        kill(trainers)


@pytest.fixture(scope="module")
def moe_pair(fleet):
    """Qwen3-MoE (tiny_moe: layer 0 dense, 8 experts in layers 1-2) at EP=2 on 2 ranks
    (TP=1, bf16), each holding 4 experts of each MoE layer: its transfer config (the
    smallest cluster, a reference replica at TP=1) and the ranks."""
    from actors import TransferConfig
    from configs import CONFIGS_DIR

    cfg = TransferConfig.from_files(MOE, CONFIGS_DIR / "clusters" / "local_cpu_small.yaml",
                                    update_timeout_s=120, barrier_timeout_s=60)
    trainers = start(fleet[0], tp=1, pp=1, dp=2, ep=2, model_file=MOE)
    try:
        yield cfg, trainers
    finally:
        kill(trainers)


def test_moe_experts_move_from_their_expert_parallel_ranks(moe_pair):
    """Each EP rank holds and writes 4 experts of each MoE layer under the model's expert
    indexes, with no collective; after a real step every reference engine byte equals
    the plain conversion of what the ranks hold."""
    from actors import launch_engines

    cfg, trainers = moe_pair
    with launch_engines(cfg) as replicas:
        metas = ray.get([t.wt_param_metas.remote() for t in trainers])
        experts = [sorted({int(m.name.split(".")[5]) for m in rank.params
                           if ".experts." in m.name}) for rank in metas]
        assert experts == [[0, 1, 2, 3], [4, 5, 6, 7]]
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        summary = ctl.setup()
        assert summary.gathered_bytes == 0 and min(summary.bytes_by_rank.values()) > 0
        losses = ray.get([t.train_step.remote(5) for t in trainers])
        assert len(set(losses)) == 1 and losses[0] > 0
        ctl.update(version=1)
        state = hf_state(trainers, cfg.model, 1)
        assert sum(".experts." in n for n in state) == 2 * 8 * 3  # every expert, once
        assert engine_mismatches(cfg.model, trainers, replicas, state=state) == []


@pytest.mark.vllm
def test_vllm_holds_the_experts_of_expert_parallel_ranks(moe_pair, tmp_path):
    """The EP=2 pair into a real vLLM of tiny_moe at TP=1 (float32): nothing gathered, each
    rank writes its own experts; after a real step every registered byte equals vLLM's own
    load_weights of the oracle's state dict (per-expert Hugging Face names)."""
    from safetensors.torch import save_file
    from vllm_fleet import ORACLE_ENV, assert_registered_equal

    from actors import TransferConfig
    from actors.tools.testkit.vllm_oracle import save_checkpoint
    from actors.vllm.engine import launch_vllm_engines
    from configs import CONFIGS_DIR

    _, trainers = moe_pair
    cfg = TransferConfig.from_files(MOE, CONFIGS_DIR / "clusters" / "vllm_cpu_tp1.yaml",
                                    update_timeout_s=120, barrier_timeout_s=60)
    cfg = cfg.replace(model=cfg.model.model_copy(update={"torch_dtype": "float32"}))
    _, start_path = save_checkpoint(MOE, seed=3, root=tmp_path)
    with launch_vllm_engines(cfg, str(start_path), env=ORACLE_ENV) as replicas:
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        try:
            summary = ctl.setup()
            assert summary.gathered_bytes == 0 and min(summary.bytes_by_rank.values()) > 0
            ray.get([t.train_step.remote(6) for t in trainers])
            ctl.update(version=1)
            path = tmp_path / "megatron-moe-v1"
            path.mkdir()
            save_file({n: t.float().contiguous() for n, t in
                       hf_state(trainers, cfg.model, 1).items()},
                      str(path / "model.safetensors"))
            assert_registered_equal(replicas.owners[0], path, tp=1)
        finally:
            ctl.shutdown()


# ------------------------------------------------------------------ into a real vLLM

PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]
TOKENS = 6
LOGPROB_ATOL = 1e-4  # float32 both sides; their kernels sum in other orders


@pytest.fixture
def vllm_engine(fleet, tmp_path_factory):
    """One vLLM replica at TP=2 in float32 (``configs/clusters/vllm_cpu.yaml``: the module's
    2 trainer ranks -> 1 x TP2), from a random checkpoint; its config, the replicas and a
    scratch folder; stopped after its one test, not held through the smoke runs."""
    from vllm_fleet import LLAMA, ORACLE_ENV, START_SEED, tiny_llama_config

    from actors.tools.testkit.vllm_oracle import save_checkpoint
    from actors.vllm.engine import launch_vllm_engines

    root = tmp_path_factory.mktemp("megatron-vllm")
    cfg = tiny_llama_config("vllm_cpu.yaml", update_timeout_s=120, barrier_timeout_s=60)
    _, start_path = save_checkpoint(LLAMA, seed=START_SEED, root=root)
    with launch_vllm_engines(cfg, str(start_path), env=ORACLE_ENV) as replicas:
        yield cfg, replicas, root


@pytest.mark.vllm
def test_vllm_holds_and_serves_the_weights_megatron_holds(fleet, vllm_engine):
    """Megatron TP=2 (bf16) -> vLLM TP=2 (float32): nothing is gathered; each trainer rank
    writes its own shards into the vLLM worker of its TP coordinate (both cut the padded
    vocabulary at row 512), and into the other worker at most the replicated norms; every
    registered byte in both workers equals vLLM's own load_weights of the oracle's
    checkpoint; vLLM's greedy tokens and their log-probs are Megatron's own forward's
    (float32)."""
    from vllm_fleet import assert_registered_equal

    _, _, trainers, _ = fleet
    cfg, replicas, root = vllm_engine
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    try:
        summary = ctl.setup()
        assert summary.gathered_bytes == 0 and summary.gathered_params == 0
        for rank, dest in summary.dest_bytes_by_rank.items():  # both write their own worker's
            assert dest["engine0"][rank] > NORM_BYTES >= dest["engine0"].get(1 - rank, 0)
        losses = ray.get([t.train_step.remote(11) for t in trainers])
        assert losses[0] > 0
        ctl.update(version=1)
        assert ctl.weights_version() == {"engine0": 1}
        path = save_hf(hf_state(trainers, cfg.model, 2), cfg.model, root / "megatron-v1")
        assert_registered_equal(replicas.owners[0], path, tp=2)

        params = {"max_tokens": TOKENS, "temperature": 0.0, "logprobs": 0}
        served = ray.get(replicas.owners[0].sample.remote(PROMPTS, params))
        for prompt, (choice,) in zip(PROMPTS, served, strict=True):
            seq = prompt + choice["token_ids"]
            want = next(lp for lp in ray.get([t.megatron_logprobs.remote(seq)
                                              for t in trainers]) if lp is not None)
            steps = range(len(prompt) - 1, len(seq) - 1)  # the positions that chose a token
            assert [int(want[i].argmax()) for i in steps] == choice["token_ids"]
            megatron = torch.tensor([float(want[i, seq[i + 1]]) for i in steps])
            torch.testing.assert_close(torch.tensor(choice["logprobs"]), megatron,
                                       atol=LOGPROB_ATOL, rtol=0)
    finally:
        ctl.shutdown()


# ------------------------------------------------------------------ the demo and the bench


def test_demo_and_bench_designs_with_megatron_trainers(ray_job, smallest_demo_run, tmp_path):
    """``wt demo --trainer megatron`` (train steps, an update after each, verified) and
    ``wt bench designs --trainer megatron`` (p2p beside slime's native, capped and
    uncapped, every design verified), smoke runs on one fleet of the demo's smallest shape
    (2 Megatron ranks at TP=2 -> 1 replica x TP1)."""
    from trainer_smoke import demo_and_bench  # tests/integration

    doc = demo_and_bench("megatron", smallest_demo_run, tmp_path)
    # TP=2 into TP1: ours writes every shard from its rank, gathers only the row-parallel
    # o_proj and down_proj
    assert doc["p2p_plan"]["gathered_bytes"] == ROW_PARALLEL_BYTES
