"""A user's own async Ray actor holding a vLLM ``AsyncLLM`` (verl's agent loop, SkyRL) is a
replica of the unchanged controller: docs/embedding.md's snippet runs as written. Sampled
requests are in flight when the update starts; vLLM pauses them in mode ``keep``, they
continue with the new weights, and their outputs' ``weight_versions`` spans cover every
token; a request after the update is sampled by the new version alone. After the update
the registered bytes hash as the controller's integrity check expects, greedy generations
equal the trainers' model, and vLLM reports the version.

The same engine serves a LoRA adapter (issue 35) through the actor's ``wt_lora``, with this
test process as the trainer: the adapter is written one-sided into its free slot and
flipped while a request under it runs (its tokens before the flip are the previous
version's, vLLM's scheduler paused in mode ``keep``); the served slot's bytes equal vLLM's
own load of a PEFT checkpoint of the same adapter, and the served name's greedy tokens
equal that checkpoint's; a rollback gives the previous version's tokens exactly; a rank
the engine cannot hold is refused by name with no slot taken.

When the user kills the actor, every process its engine started is gone and nothing they
mapped in /dev/shm is left.

One engine start for the module (inside the user's actor; LoRA on: ``max_loras=3``, our
two slots and one for vLLM's load of the oracle checkpoint, ``max_lora_rank`` the
adapter's rank). The tests run in file order on it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import ray
from vllm_fleet import (  # tests/integration is on sys.path
    LLAMA,
    START_SEED,
    assert_engine_gone,
    engine_processes,
    train_step,
)

from actors.tools.testkit.doc_snippets import run_snippet
from actors.tools.testkit.vllm_oracle import save_checkpoint
from actors.tools.testkit.vllm_oracle_ext import EXTENSION
from weight_transfer.engines.vllm.driver import IN_CORE_EXECUTOR

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"
PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999], [3, 3, 3], [77]]
RANK = 8  # the adapter's rank, the engine's max_lora_rank
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "skip_tokenizer_init": True,
               "max_model_len": 256, "kv_cache_memory_bytes": 32 << 20,
               "enable_lora": True, "max_loras": 3, "max_lora_rank": RANK,
               # the model inside the engine core, as vLLM runs TP1 on GPU (one process
               # fewer than vLLM's CPU default; the snippet does not depend on it)
               "distributed_executor_backend": IN_CORE_EXECUTOR,
               "worker_extension_cls": EXTENSION}  # the LoRA slot oracle, by name


@pytest.fixture(scope="module")
def served(vllm_trainers, tmp_path_factory):
    """docs/embedding.md's async actor snippet run once: the namespace it leaves (the
    actor, its replicas, the controller); the actor killed at the end and its engine
    checked gone."""
    handle = vllm_trainers  # tiny_llama, float32, for one TP=1 replica (conftest.py)
    root = tmp_path_factory.mktemp("async-actor")
    start_model, start = save_checkpoint(LLAMA, seed=START_SEED, root=root)
    train_step(handle, seed=1)
    ns = {"model_path": str(start), "engine_args": ENGINE_ARGS, "trainers": handle,
          "step": 1, "prompts": PROMPTS}
    pids, segments = [], []
    try:
        run_snippet(DOC, "vllm-async-actor", ns)
        ns.update(root=root, start_model=start_model)
        yield ns
    finally:
        if "ctl" in ns:
            ns["ctl"].shutdown()
        if "replicas" in ns:
            ns["replicas"].close()
        if "actor" in ns:
            pids, segments = engine_processes(ns["actor"])
            ray.kill(ns["actor"])
    assert pids, "the user's AsyncLLM runs its engine core in a process of its own"
    assert_engine_gone(pids, segments)


def test_doc_snippet_updates_your_own_asyncllm_while_requests_run(served):
    ns, handle = served, served["trainers"]
    ctl, actor = ns["ctl"], ns["actor"]
    report = ns["report"]
    assert report.version == 1 and report.bytes == ctl.summary.bytes_total > 0
    assert report.integrity.mismatches == ()
    for tokens_out, spans in ns["results"]:  # in flight across the update, or before it
        assert len(tokens_out) == 128
        assert spans[0][1] == 0 and spans[-1][2] == 128
        assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))
        assert {s[0] for s in spans} <= {"default", "1"}
    _, after = ray.get(actor.generate.remote(PROMPTS[0], ns["sampled"]))
    assert after == [("1", 0, 128)]
    assert ray.get(actor.wt_vllm.remote("vllm_version")) == "1"
    want = ray.get([t.reference_generate.remote(PROMPTS, 8) for t in handle])[0]
    got = ray.get(ns["replicas"][0][0].generate.remote(PROMPTS, 8))
    assert got == want
    assert ctl.weights_version() == {"engine0": 1}


def test_a_lora_adapter_flips_in_your_asyncllm_while_a_request_runs(served):
    from vllm import SamplingParams

    from actors.tools.testkit.lora_oracle import adapter_flow

    pytest.importorskip("peft", reason="the `lora` extra (peft) is not installed")
    actor = served["actor"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)

    def tokens(lora_request):  # the user's own generate, one request at a time
        return [ray.get(actor.generate.remote(p, greedy, lora_request))[0] for p in PROMPTS]

    adapter_flow(actor, served["replicas"][0][0], root=served["root"],
                 start_model=served["start_model"], rank=RANK, tokens=tokens, overtake=True)
