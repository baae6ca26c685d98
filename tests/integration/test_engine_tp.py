"""The reference engine with real tensor parallelism: two spawned processes, gloo on loopback.

Each rank builds the same seeded transformers model, loads its own shard of it
and runs forward/generate together with its peer. The parent compares against
the unsharded transformers model: logits to float32 rounding (max |diff| < 1e-4;
FP8 engines against the FP8 round trip of the model), greedy tokens of bf16
engines exactly, on both ranks. Shards covered: TP2 dense with vocab padding (tiny_llama),
replicated KV heads and tied embeddings (tiny_qwen2), MoE with TP-sharded
experts and with expert parallelism (tiny_moe), and FP8. The last part checks
the adapter's agreed pause: rank 0 pauses during step 2, rank 1 gets its pause
only later, and both hold generation after the same step.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from weight_transfer.engines.reference.adapter import ReferenceEngineAdapter
from weight_transfer.engines.reference.engine import ReferenceEngine
from weight_transfer.engines.reference.hf_model import (
    build_hf_model,
    float_logits,
    fp8_float_copy,
    greedy_generate,
)
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.model.models import load_model_config
from weight_transfer.sync.listen import serve_store
from weight_transfer.types import ShardSpec

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
SEED = 4
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8], [600, 601, 602, 603]]
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [600, 7, 1, 8, 2, 8, 630, 8]])
STEPS = 5
WAIT = 240.0  # bounds a failure only
PARK_WAIT = 120.0
# (model, fp8, expert parallel)
CASES = [
    ("tiny_llama", False, False),
    ("tiny_qwen2", False, False),
    ("tiny_moe", False, False),
    ("tiny_moe", False, True),
    ("tiny_moe", True, False),
    ("tiny_llama", True, False),
]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def shard_of(rank: int, ep: bool) -> ShardSpec:
    return ShardSpec(tp_rank=rank, tp_size=2, ep_rank=rank if ep else 0, ep_size=2 if ep else 1)


# --------------------------------------------------------------------------- worker side


def _engine(name: str, fp8: bool, ep: bool, rank: int) -> ReferenceEngine:
    cfg = load_model_config(MODELS / f"{name}.yaml")
    engine = ReferenceEngine(cfg, shard_of(rank, ep), fp8=fp8, group=dist.group.WORLD)
    engine.load_state(build_hf_model(cfg, seed=SEED).state_dict())
    return engine


def _pause_agreement(rank: int, conn) -> None:
    engine = _engine("tiny_llama", False, False, rank)
    adapter = ReferenceEngineAdapter(engine)
    calls, forward = [], engine.forward

    def counting_forward(ids):
        calls.append(ids.shape[1])
        if rank == 0 and len(calls) == 2:
            adapter.pause()  # only rank 0 is paused, during step 2
        return forward(ids)

    engine.forward = counting_forward
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(tokens=engine.generate(PROMPTS[:2], STEPS)), daemon=True
    )
    thread.start()
    conn.send(("parked", adapter.wait_parked(PARK_WAIT), len(calls), adapter.paused))
    while (cmd := conn.recv()) != "done":
        getattr(adapter, cmd)()
    thread.join(WAIT)
    conn.send(("tokens", result.get("tokens"), len(calls)))


def worker(rank: int, port: int, conn) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        for name, fp8, ep in CASES:
            engine = _engine(name, fp8, ep, rank)
            tokens = None if fp8 else engine.generate(PROMPTS, STEPS)
            conn.send((engine.forward(IDS), tokens, engine.state_bytes()))
        _pause_agreement(rank, conn)
    except BaseException as exc:
        conn.send(exc)
        raise
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- parent side


def _recv(pipe):
    if not pipe.poll(WAIT):
        raise TimeoutError(f"no answer from a TP worker within {WAIT} s")
    msg = pipe.recv()
    if isinstance(msg, BaseException):
        raise msg
    return msg


@pytest.fixture(scope="module")
def ranks():
    ctx = mp.get_context("spawn")
    store = serve_store("127.0.0.1", timeout_s=120)
    pipes, procs = [], []
    for r in range(2):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(r, store.port, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    results = {case: [_recv(p) for p in pipes] for case in CASES}
    yield results, pipes
    for pipe in pipes:  # release a held generation if the pause test did not run
        with contextlib.suppress(OSError):
            for cmd in ("pause", "resume", "done"):
                pipe.send(cmd)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    del store


@pytest.fixture(scope="module")
def hf_models():
    names = sorted({name for name, _, _ in CASES})
    return {n: build_hf_model(load_model_config(MODELS / f"{n}.yaml"), seed=SEED) for n in names}


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-fp8={f}-ep={e}" for n, f, e in CASES])
def test_tp2_matches_the_unsharded_model(ranks, hf_models, case):
    name, fp8, _ = case
    model = hf_models[name]
    (logits0, tokens0, _), (logits1, tokens1, _) = ranks[0][case]
    want = float_logits(fp8_float_copy(model) if fp8 else model, IDS)
    for logits in (logits0, logits1):
        diff = (logits - want).abs().max().item()
        assert diff < 1e-4, f"{case}: max |logit diff| {diff}"
    if not fp8:
        assert tokens0 == tokens1 == greedy_generate(model, PROMPTS, STEPS)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-fp8={f}-ep={e}" for n, f, e in CASES])
def test_tp2_shards_hold_the_reference_bytes(ranks, hf_models, case):
    name, fp8, ep = case
    cfg = load_model_config(MODELS / f"{name}.yaml")
    for rank, (_, _, state) in enumerate(ranks[0][case]):
        want = load_engine_shard(cfg, hf_models[name].state_dict(), shard_of(rank, ep), fp8=fp8)
        assert set(state) == set(want)
        for n, t in want.items():
            assert torch.equal(state[n], t.contiguous().view(torch.uint8).flatten()), n


def test_tp_ranks_pause_at_the_same_step(ranks, hf_models):
    _, pipes = ranks
    parked = [_recv(p) for p in pipes]
    # both held after step 2; rank 1 without having been paused itself
    assert parked == [("parked", True, 2, True), ("parked", True, 2, False)]
    pipes[1].send("pause")  # rank 1's pause arrives late
    for p in pipes:
        p.send("resume")
        p.send("done")
    done = [_recv(p) for p in pipes]
    want = greedy_generate(hf_models["tiny_llama"], PROMPTS[:2], STEPS)
    assert done == [("tokens", want, STEPS), ("tokens", want, STEPS)]
