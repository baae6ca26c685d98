"""A real DeepSpeed ZeRO trainer as the source: gloo ranks on CPU -> reference engines, vLLM.

The trainer actor is docs/embedding.md's ``deepspeed-trainer`` snippet as written (a
transformers LlamaForCausalLM of tiny_llama's shape built under ``deepspeed.zero.Init``,
AdamW), with a train step and the oracle added by subclassing. After a real optimizer
step and an update, every engine byte equals the engine's own load of the weights
DeepSpeed itself consolidates (``deepspeed.zero.GatheredParameters`` in the trainer, not
the plan):

* bf16 ZeRO-3 on 2 ranks into reference engines at TP=1 and TP=2 and an FP8 one at TP=2
  (scales included): every rank's partition of each matrix goes straight from
  ``ds_tensor``, only the norms are gathered (their bytes reported apart); the
  checkpoint the mixin writes from the partitions; then ZeRO-2 as a replicated source
  whose writes both ranks share (the same two actors, switched to a ZeRO-2 engine of a
  new model: two DeepSpeed processes fewer to start).
* float32 ZeRO-3 on 4 ranks with ``offload_param: cpu`` into a real vLLM at TP=2, on a
  vocabulary of 1001, so that the partitions of the embedding and the head start and end
  inside rows: the plan writes whole rows and the partial rows at the edges direct into
  vLLM's vocab-parallel shards and gathers only the norms. Every registered byte equals
  vLLM's own ``load_weights`` of DeepSpeed's consolidation saved as a Hugging Face
  checkpoint and, black-box, the DeepSpeed-wrapped model's forward gives vLLM's greedy
  tokens with their log-probabilities (within ``LOGPROB_ATOL``). vLLM at TP=1 is not
  started here: DeepSpeed's partitions into a TP=1 layout are the TP=1 reference
  engine's subject, and vLLM's own TP=1 layout, which does not depend on the source, is
  tested from FSDP2 and Megatron trainers.
* ``wt demo --trainer deepspeed`` and ``wt bench designs --trainer deepspeed`` (p2p
  beside OpenRLHF's native) as smoke runs on one fleet of the demo's smallest shape.

One fleet for the module: the two bf16 ZeRO-3 trainer actors (ZeRO-2 in its last test),
one TP=1 replica and one TP=2 replica, each with its own controller over the same trainers
(the vLLM fleet and the demo's fleet start in their tests).
"""

from __future__ import annotations

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
from actors.tools.testkit.source_fleet import (
    fp8_update,
    free_port,
    kill,
    reference_engines,
    start_trainers,
)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "embedding.md"
CONFIGS = ROOT / "configs"

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (scripts/setup.sh installs it)"),
]

# tiny_llama.yaml as transformers' config (the engines plan with the yaml itself)
LLAMA = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=128, intermediate_size=512, vocab_size=1000, tie_word_embeddings=False,
             rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=2048)
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
NORM_BYTES = 5 * 256 * 2  # two RMSNorms per layer and the final one, bf16
# the vLLM fleet: float32 ZeRO-3 with its partitions on the host, on a vocabulary that
# 4 partitions cut inside rows (tiny_llama's 1000 x 256 splits 4 ways between rows)
ZERO3_OFFLOAD = {"stage": 3, "offload_param": {"device": "cpu"}}
VOCAB4 = 1001
NORM_BYTES32 = 5 * 256 * 4
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors take our classes


def make_model(dtype: str = "bfloat16", vocab: int = LLAMA["vocab_size"]):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, "vocab_size": vocab}, dtype=dtype))


def make_model32():
    return make_model("float32", VOCAB4)


def trainer_class():
    """The snippet's actor class, with what the test needs of it."""
    os.environ.update(ENV)  # the snippet imports deepspeed in this driver too
    snippet = run_snippet(DOC, "deepspeed-trainer", {})["DeepSpeedTrainer"]

    class TestTrainer(snippet.__ray_metadata__.modified_class):
        def __init__(self, rank, world, port):
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            # before zero.Init: under it, torch._dynamo's first import (by transformers'
            # modeling code) fails on the tensor constructor zero.Init patches
            from transformers import LlamaForCausalLM  # noqa: F401

            super().__init__(rank, world, make_model, DS_CONFIG, backend="gloo")

        def train_step(self, seed: int) -> float:
            tokens = torch.randint(0, LLAMA["vocab_size"], (1, 24),
                                   generator=torch.Generator().manual_seed(seed))
            loss = self.engine(input_ids=tokens, labels=tokens).loss
            self.engine.backward(loss)
            self.engine.step()
            return float(loss.detach())

        def zero_stage(self) -> int:
            return self.engine.zero_optimization_stage()

        def offload_device(self) -> str | None:
            offload = self.engine.zero_offload_param()
            return None if offload is None else str(offload.device)

        def log_probs(self, sequences: list[list[int]]):
            """The DeepSpeed-wrapped model's next-token log-probabilities [B, T, vocab] in
            float32 (every rank calls: ZeRO-3's forward gathers; rank 0 answers)."""
            with torch.no_grad():
                logits = self.engine(input_ids=torch.tensor(sequences)).logits
            out = torch.log_softmax(logits.float(), dim=-1)
            return out if self.engine.global_rank == 0 else None

        def full_state_dict(self):
            """The oracle: DeepSpeed's own consolidation of the current weights (every rank
            calls; rank 0 answers)."""
            import deepspeed

            params = dict(self.engine.module.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                full = {n: p.data.detach().clone() for n, p in params.items()}
            return full if self.engine.global_rank == 0 else None

        def to_zero2(self) -> int:
            """This rank trains a new model of the same shape under ZeRO-2 (full bf16
            parameters on every rank: a replicated source) from now on, its NICs closed
            and the new engine attached: the module's ZeRO-2 case without starting two more
            DeepSpeed processes. Returns the new engine's ZeRO stage."""
            import deepspeed

            self.wt_close()
            config = {**DS_CONFIG, "zero_optimization": {"stage": 2}}
            model = make_model()
            self.engine, *_ = deepspeed.initialize(model=model, config=config,
                                                   model_parameters=model.parameters())
            self.wt_attach(model=self.engine, rank=self.engine.global_rank,
                           world=self.engine.world_size)
            return self.engine.zero_optimization_stage()

    class Float32Trainer(TestTrainer):
        """ZeRO-3 in float32 with its partitions offloaded to the host (offload_param cpu),
        on the vLLM fleet's vocabulary."""

        def __init__(self, rank, world, port):
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            from transformers import LlamaForCausalLM  # noqa: F401  (see TestTrainer)

            config = {**DS_CONFIG, "bf16": {"enabled": False},
                      "zero_optimization": ZERO3_OFFLOAD}
            super(TestTrainer, self).__init__(rank, world, make_model32, config,
                                              backend="gloo")

    return ray.remote(TestTrainer), ray.remote(Float32Trainer)


@pytest.fixture(scope="module")
def fleet(ray_job):
    zero3, _ = trainer_class()
    with reference_engines(CONFIGS / "models" / "tiny_llama.yaml", update_timeout_s=120,
                           barrier_timeout_s=60) as (configs, engines):
        trainers = start(zero3)
        try:
            yield configs, trainers, engines
        finally:
            kill(trainers)


def start(cls, world: int = 2):
    port = free_port()
    return start_trainers(cls, [(r, world, port) for r in range(world)], env=ENV)


@pytest.mark.parametrize("tp", [1, 2])
def test_engines_hold_the_weights_deepspeed_consolidates(fleet, tp):
    configs, trainers, engines = fleet
    cfg, replicas = configs[tp], engines[tp]
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    summary = ctl.setup()
    # the partitions go direct; only the norms (2 x 256 B per rank) are gathered
    assert summary.gathered_bytes == NORM_BYTES * tp and summary.gathered_params == 5
    assert summary.direct_bytes == summary.bytes_total - summary.gathered_bytes > 0
    assert all(n > 0 for n in summary.bytes_by_rank.values())  # both ranks write
    before = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    losses = ray.get([t.train_step.remote(tp) for t in trainers])
    assert len(set(losses)) == 1 and losses[0] > 0
    report = ctl.update(version=tp)
    assert report.bytes == summary.bytes_total
    assert ctl.weights_version() == {"engine0": tp}
    assert engine_mismatches(cfg.model, trainers, replicas) == []
    after = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    assert any(not torch.equal(before[n], after[n]) for n in after)  # the step moved them


def test_checkpoint_holds_the_weights_deepspeed_consolidates(fleet, tmp_path):
    _, trainers, _ = fleet
    from safetensors.torch import load_file

    assert ray.get([t.wt_save_checkpoint.remote(str(tmp_path)) for t in trainers]) == [True,
                                                                                        False]
    saved = load_file(str(tmp_path / "model.safetensors"))
    want = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    assert saved.keys() == want.keys()
    assert all(torch.equal(saved[n], want[n]) for n in want)


def test_fp8_engines_hold_the_reference_quantization_of_deepspeed_weights(fleet):
    """An FP8 replica at TP=2 (128x128 blocks, one scale per block) fed by the ZeRO-3 ranks:
    every engine byte, weights and scales, equals the reference quantization of what
    DeepSpeed consolidates after a real step. Each rank quantizes the blocks its partition
    holds: tiny_llama's 2 partitions split every matrix at a block edge, so every block
    goes direct and only the norms are gathered (a partition that cuts a block gathers it:
    tests/unit/test_flat_partitions.py, 3 ranks)."""
    configs, trainers, _ = fleet
    with fp8_update(configs[2], trainers, version=20) as (summary, replicas):
        assert summary.gathered_bytes == NORM_BYTES * 2 and summary.gathered_params == 5
        assert summary.direct_bytes == summary.bytes_total - summary.gathered_bytes > 0
        assert engine_mismatches(configs[2].model, trainers, replicas, fp8=True) == []


def test_zero2_engine_is_a_replicated_source(fleet):
    """The fleet's ranks switched to ZeRO-2 (``to_zero2``: the module's last use of them,
    its ZeRO-3 tests ran before): every rank holds every parameter, the writes spread."""
    configs, trainers, engines = fleet
    cfg, replicas = configs[1], engines[1]
    assert ray.get([t.to_zero2.remote() for t in trainers]) == [2, 2]
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    summary = ctl.setup()
    assert summary.gathered_bytes == 0 and summary.direct_bytes == summary.bytes_total
    sent = list(summary.bytes_by_rank.values())
    assert min(sent) > 0.8 * max(sent)  # the writes spread over both ranks
    ray.get([t.train_step.remote(7) for t in trainers])
    ctl.update(version=10)
    assert engine_mismatches(cfg.model, trainers, replicas) == []


# ------------------------------------------------------------------------ a real vLLM
# One fleet covers ZeRO-3 on 4 ranks, offload_param cpu and vLLM at TP=2: float32 trainers
# (vLLM on CPU computes in float32: the forwards compare) on a vocabulary of 1001, so that
# the 4 partitions of the embedding and the head (1001 x 256) start and end inside rows
# (250.25, 500.5, 750.75), inside vLLM's vocab-parallel shards (rows 0-511, 512-1023).

PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
LOGPROB_ATOL = 1e-4  # float32 on both sides, other kernels (measured: 2.4e-6 at most)


@pytest.fixture  # one test: its engine stops right after it (vLLM's TP=2 workers spin)
def vllm_replica(ray_job, tmp_path_factory, cluster_file):
    import yaml
    from vllm_fleet import ORACLE_ENV  # tests/integration

    from actors import TransferConfig
    from actors.tools.testkit.vllm_oracle import save_checkpoint
    from actors.vllm.engine import launch_vllm_engines

    root = tmp_path_factory.mktemp("deepspeed-vllm")
    model = yaml.safe_load((CONFIGS / "models" / "tiny_llama.yaml").read_text())
    model.update(name=f"tiny-llama-v{VOCAB4}", vocab_size=VOCAB4, torch_dtype="float32")
    (model_file := root / "model.yaml").write_text(yaml.safe_dump(model))
    cfg = TransferConfig.from_files(model_file, cluster_file(trainers=4, replicas=1, tp=2),
                                    update_timeout_s=120, barrier_timeout_s=60)
    _, start_path = save_checkpoint(model_file, seed=11, root=root)  # not the trainers'
    trainers = start(trainer_class()[1], world=4)
    try:
        with launch_vllm_engines(cfg, str(start_path), env=ORACLE_ENV,
                                 trainers=trainers) as replicas:
            ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
            try:
                yield cfg, trainers, replicas, ctl, root
            finally:
                ctl.shutdown()
    finally:
        kill(trainers)


def greedy_problems(trainers, owner) -> list[str]:
    """vLLM's greedy tokens and their log-probabilities against the DeepSpeed model's
    forward over the same sequences (teacher-forced: equal argmax at every step is the
    same greedy generation); prints the largest log-probability difference."""
    problems, worst = [], 0.0
    outs = [c[0] for c in ray.get(owner.sample.remote(PROMPTS, GREEDY))]
    seqs = [p + o["token_ids"] for p, o in zip(PROMPTS, outs, strict=True)]
    want = ray.get([t.log_probs.remote(seqs) for t in trainers])[0]
    for b, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        for j, (token, lp) in enumerate(zip(out["token_ids"], out["logprobs"], strict=True)):
            row = want[b, len(prompt) - 1 + j]
            if int(row.argmax()) != token:
                problems.append(f"prompt {b} token {j}: vLLM {token}, DeepSpeed "
                                f"{int(row.argmax())}")
            worst = max(worst, abs(float(row[token]) - lp))
            if abs(float(row[token]) - lp) > LOGPROB_ATOL:
                problems.append(f"prompt {b} token {j}: log-prob vLLM {lp:.6f}, DeepSpeed "
                                f"{float(row[token]):.6f}")
    print(f"largest |log-prob vLLM - DeepSpeed|: {worst:.2e}")
    return problems


def edge_rows(ctl) -> set[tuple[str, int, int, int]]:
    """(parameter, row, trainer rank, engine TP rank) of every direct write of a partial
    row of the plan (a partition starts or ends inside that row)."""
    from scheduling.serialize import loads_plan

    plan = loads_plan(ray.get(ctl.scheduler.plan_blob.remote()))
    direct = plan.task_direct()
    out = set()
    for row in range(plan.num_tasks):
        piece = plan.pieces[int(plan.task_piece[row])]
        if len(piece.src_shape) == 2 and piece.src_shape[0] == 1 and piece.src_shape[1] < 256:
            assert direct[row], f"partial row {piece} gathered"
            out.add((piece.src_param, piece.src_slice[0][0], int(plan.task_src[row]),
                     plan.engines[int(plan.task_dst[row])].rank))
    return out


@pytest.mark.vllm
def test_vllm_tp2_holds_the_weights_of_four_offloaded_zero3_ranks(vllm_replica):
    from vllm_fleet import assert_registered_equal, trainer_checkpoint

    cfg, trainers, replicas, ctl, root = vllm_replica
    assert ray.get(trainers[0].offload_device.remote()) == "cpu"
    summary = ctl.setup()
    print(f"4 ZeRO-3 ranks -> vLLM TP=2: {summary.direct_bytes} B direct, "
          f"{summary.gathered_bytes} B gathered, by rank {summary.bytes_by_rank}")
    # the partitions go direct (every rank writes); only the norms are gathered, whole on
    # both TP ranks
    assert summary.gathered_params == 5 and summary.gathered_bytes == NORM_BYTES32 * 2
    assert summary.direct_bytes == summary.bytes_total - summary.gathered_bytes > 0
    assert sorted(summary.bytes_by_rank) == [0, 1, 2, 3]
    assert all(n > 0 for n in summary.bytes_by_rank.values())
    # each cut row of the embedding and the head: its two sides from the two ranks that
    # hold them, into the TP rank whose vocab shard holds the row
    want = {(f"{p}.weight", row, rank, row // 512)
            for p in ("model.embed_tokens", "lm_head")
            for cut, row in enumerate((250, 500, 750)) for rank in (cut, cut + 1)}
    assert edge_rows(ctl) == want
    assert greedy_problems(trainers, replicas.owners[0])  # a random start: not the trainers'
    ray.get([t.train_step.remote(1) for t in trainers])
    ctl.update(version=1)
    assert ctl.weights_version() == {"engine0": 1}
    # every registered byte == vLLM's own load_weights of DeepSpeed's consolidation
    _, path = trainer_checkpoint(cfg, trainers, root, 1)
    assert_registered_equal(replicas.owners[0], path, tp=2)
    # black box: the DeepSpeed model's forward and vLLM agree, token for token
    assert greedy_problems(trainers, replicas.owners[0]) == []


# ------------------------------------------------------------------------ wt demo, wt bench
def test_demo_and_bench_designs_with_deepspeed_trainers(ray_job, smallest_demo_run, tmp_path):
    """``wt demo --trainer deepspeed`` (train steps, an update after each, verified) and
    ``wt bench designs --trainer deepspeed`` (p2p beside native, capped and uncapped,
    every design verified), smoke runs on one fleet of the demo's smallest shape."""
    from trainer_smoke import demo_and_bench  # tests/integration

    doc = demo_and_bench("deepspeed", smallest_demo_run, tmp_path)
    plan = doc["p2p_plan"]  # ours writes the partitions, gathers only the norms
    assert 0 < plan["gathered_bytes"] < plan["direct_bytes"]
