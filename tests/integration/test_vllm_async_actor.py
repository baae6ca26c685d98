"""A user's own async Ray actor holding a vLLM ``AsyncLLM`` (verl's agent loop, SkyRL) is a
replica of the unchanged controller: docs/embedding.md's snippet runs as written. Sampled
requests are in flight when the update starts; vLLM pauses them in mode ``keep``, they
continue with the new weights, and their outputs' ``weight_versions`` spans cover every
token; a request after the update is sampled by the new version alone. After the update
the registered bytes hash as the controller's integrity check expects, greedy generations
equal the trainers' model, and vLLM reports the version.

When the user kills the actor, every process its engine started is gone and nothing they
mapped in /dev/shm is left.

One engine start for the module (inside the user's actor).
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

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"
PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999], [3, 3, 3], [77]]
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "skip_tokenizer_init": True,
               "max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}


def test_doc_snippet_updates_your_own_asyncllm_while_requests_run(vllm_trainers, tmp_path):
    handle = vllm_trainers  # tiny_llama, float32, for one TP=1 replica (conftest.py)
    _, start = save_checkpoint(LLAMA, seed=START_SEED, root=tmp_path)
    train_step(handle, seed=1)
    ns = {"model_path": str(start), "engine_args": ENGINE_ARGS, "trainers": handle,
          "step": 1, "prompts": PROMPTS}
    try:
        run_snippet(DOC, "vllm-async-actor", ns)
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
        pids, segments = engine_processes(actor)
        assert pids, "the user's AsyncLLM runs its engine core in a process of its own"
    finally:
        if "ctl" in ns:
            ns["ctl"].shutdown()
        if "replicas" in ns:
            ns["replicas"].close()
        if "actor" in ns:
            ray.kill(ns["actor"])
    assert_engine_gone(pids, segments)
