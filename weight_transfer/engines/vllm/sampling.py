"""Sampling with the user's full ``SamplingParams`` on an ``LLM`` our driver steps.

:meth:`~weight_transfer.engines.vllm.driver.VllmLink.generate` is greedy or seeded token
ids; :func:`sample` takes any ``SamplingParams`` (as a dict: ``n``, ``logprobs``,
``top_p``, stop tokens ...) and returns every choice with its logprobs and the
weight-version spans that sampled it, stepping the engine through the link's gate
(an update waits for the running step, not for the whole batch)::

    out = sample(link, [[1, 2, 3]], {"n": 2, "max_tokens": 8, "temperature": 1.0,
                                     "logprobs": 0})
    out[0][1]["token_ids"], out[0][1]["logprobs"], out[0][1]["weight_versions"]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

_ids = itertools.count()


def choice(c: Any) -> dict[str, Any]:
    """One vLLM ``CompletionOutput`` as plain data."""
    logprobs = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or (), strict=False)]
    return {"token_ids": list(c.token_ids), "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "weight_versions": [(s.version, s.start, s.end) for s in c.weight_versions or ()]}


def sample(link: Any, prompts: Sequence[Sequence[int]], params: dict[str, Any]
           ) -> list[list[dict[str, Any]]]:
    """Per prompt, its choices (see the module docstring); ValueError naming a bad field."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    try:
        sp = SamplingParams(**{"detokenize": False, **params})
    except TypeError as exc:
        raise ValueError(f"SamplingParams: {exc}") from None
    sp.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate: all n choices at once
    engine = link.llm.llm_engine
    ids = [f"wt-sample-{next(_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), sp)
    done: dict[str, list[dict[str, Any]]] = {}
    while len(done) < len(ids):
        for out in link.gate.step(engine.step):
            if out.finished and out.request_id in ids:
                done[out.request_id] = [choice(c) for c in out.outputs]
    return [done[r] for r in ids]
