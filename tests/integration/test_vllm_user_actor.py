"""A user's own Ray actor holding an offline vLLM ``LLM`` (OpenRLHF's ``LLMRayActor``: the
user's engine arguments, the one config value, one mixin and one line) is a replica of the
unchanged controller: docs/embedding.md's snippet runs as written. After the update every
byte our backend registered equals vLLM's own load_weights of the trainers' weights (in the
worker, by a worker extension reached by name), the actor's own ``generate`` with its own
``SamplingParams`` equals the trainers' greedy tokens, and vLLM reports the version.

The same engine serves a LoRA adapter through the actor's ``wt_lora`` (issue 35), this
process as the trainer: refused above ``max_lora_rank`` with no slot taken, served only
after the flip, its slot bytes and greedy tokens vLLM's own load of a PEFT checkpoint of
it, rolled back exactly (:func:`actors.tools.testkit.lora_oracle.adapter_flow`).

When the user kills the actor, every process its engine started is gone and nothing they
mapped in /dev/shm is left.

One engine start for the module (inside the user's actor).
"""

from __future__ import annotations

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
PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]
RANK = 8  # the LoRA adapter's rank, the engine's max_lora_rank
# The model inside the engine core (IN_CORE_EXECUTOR), as vLLM runs TP1 on GPU: one process
# fewer than vLLM's CPU default; the snippet does not depend on it.
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "skip_tokenizer_init": True,
               "max_model_len": 256, "kv_cache_memory_bytes": 32 << 20,
               "distributed_executor_backend": IN_CORE_EXECUTOR,
               # a LoRA adapter beside the full weights: our two slots, one for vLLM's load
               # of the oracle checkpoint, the adapter's rank
               "enable_lora": True, "max_loras": 3, "max_lora_rank": RANK,
               "worker_extension_cls": EXTENSION}


def _oracle(llm_actor, trainers, root):
    from actors.vllm.engine import save_trainer_checkpoint

    path = save_trainer_checkpoint(list(trainers), root / "trainer-v1")
    return ray.get(llm_actor.__ray_call__.remote(
        lambda self, p: self.llm.collective_rpc("wt_oracle_check", args=(p,)), str(path)))


def _lora_adapter(actor, rank0, root, start_model):
    """A LoRA adapter through the same actor's ``wt_lora`` (issue 35), this process the
    trainer: refused above max_lora_rank, served only after the flip, its slot bytes and
    greedy tokens vLLM's own load of the PEFT checkpoint, rolled back exactly (a plain
    actor runs one call at a time: no request overtaken here, test_vllm_async_actor has
    one)."""
    from vllm import SamplingParams

    from actors.tools.testkit.lora_oracle import adapter_flow

    pytest.importorskip("peft", reason="the `lora` extra (peft) is not installed")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)

    def tokens(lora_request):  # the user's own generate
        return ray.get(actor.generate.remote(PROMPTS, greedy, lora_request))

    adapter_flow(actor, rank0, root=root, start_model=start_model, rank=RANK,
                 tokens=tokens, overtake=False)


def test_doc_snippet_updates_your_own_llm_actor(vllm_trainers, tmp_path):
    handle, root = vllm_trainers, tmp_path  # tiny_llama, float32, one TP=1 replica (conftest.py)
    start_model, start = save_checkpoint(LLAMA, seed=START_SEED, root=root)
    train_step(handle, seed=1)
    ns = {"model_path": str(start), "engine_args": ENGINE_ARGS, "trainers": handle,
          "step": 1, "prompts": PROMPTS}
    try:
        run_snippet(DOC, "vllm-offline-actor", ns)
        ctl, (actor,) = ns["ctl"], ns["llm_actors"]
        assert ns["report"].version == 1 and ns["report"].bytes == ctl.summary.bytes_total > 0
        assert ns["report"].integrity.mismatches == ()
        (answer,) = _oracle(actor, handle, root)
        assert answer["problems"] == [] and len(answer["digests"]) == 15
        want = ray.get([t.reference_generate.remote(PROMPTS, 8) for t in handle])[0]
        assert ns["outs"] == want
        assert ray.get(actor.wt_vllm.remote("vllm_version")) == "1"
        assert ctl.weights_version() == {"engine0": 1}
        params = {"n": 2, "max_tokens": 8, "temperature": 1.0, "logprobs": 0, "seed": 5}
        (choices,) = ray.get(actor.__ray_call__.remote(
            lambda self, p: self._wt_vllm_owner.sample(p, params), PROMPTS[:1]))
        assert [(len(c["token_ids"]), len(c["logprobs"]), c["weight_versions"])
                for c in choices] == [(8, 8, [("1", 0, 8)])] * 2
        with pytest.raises(ValueError, match="unknown method 'shutdown_now'"):
            ray.get(actor.wt_vllm.remote("shutdown_now"))
        _lora_adapter(actor, ns["replicas"][0][0], root, start_model)
        pids, segments = engine_processes(actor)
        assert pids, "the user's LLM runs its engine core in a process of its own"
    finally:
        if "ctl" in ns:
            ns["ctl"].shutdown()
        if "replicas" in ns:
            ns["replicas"].close()
        for a in ns.get("llm_actors", ()):
            ray.kill(a)
    assert_engine_gone(pids, segments)
