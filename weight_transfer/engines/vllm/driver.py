"""Driver side of our vLLM backend: the process that owns the ``LLM``.

::

    llm = LLM(model=path, weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME), ...)
    link = VllmLink(llm)
    metas = link.setup(SetupRequest(replica="engine0", nics=("inode0/nic0",), transport=spec))
    peers = link.call("endpoints", requests, rank=0)[0]      # connection set-up, round 1
    link.call("connect", conns, rank=0)                       # round 2
    link.pause()                 # no new step starts; vLLM's start_weight_update
    ...                          # the trainers write one-sided into the registered memory
    link.resume(version=7)       # finish_weight_update("7") + prefix-cache reset, steps go on
    link.generate([[1, 2, 3]], max_new_tokens=8)   # greedy; waits while paused

``generate`` runs vLLM's engine loop itself, one ``step()`` at a time, and
checks the gate before each step: ``pause`` returns once the running step has
ended (a step boundary). Requests in flight stay queued; at ``resume`` the
prefix cache is reset with ``reset_running_requests=True``, so no KV computed
with the old weights is reused (those requests are recomputed).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

from weight_transfer.engines.vllm.mailbox import Mailbox, SetupRequest
from weight_transfer.types import EngineRankMeta

log = logging.getLogger(__name__)

# A small engine for tests and the demo: prompts as token ids, no CUDA graphs, little KV.
SMALL_ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                    kv_cache_memory_bytes=32 << 20)


class StepGate:
    """Lets engine steps run unless paused; ``pause`` waits for the running step to end."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._step = threading.Lock()

    def pause(self, timeout_s: float) -> None:
        self._open.clear()
        if not self._step.acquire(timeout=timeout_s):
            raise TimeoutError(f"a vLLM step still runs {timeout_s:g} s after pause()")
        self._step.release()

    def resume(self) -> None:
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def step(self, fn):
        """Run one step when open; the lock marks it running."""
        self._open.wait()
        with self._step:
            return fn()


class VllmLink:
    """Our backend in every worker of one ``LLM``; see the module docstring."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.tp_size = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        self.box = Mailbox.create()
        self.gate = StepGate()
        self._updating = False
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one backend operation at a time

    def call(self, op: str, request: Any = None, *, rank: int = -1) -> list[Any]:
        """Run ``op`` in the worker of TP rank ``rank`` (-1: every rank); their replies."""
        with self._lock:
            info = self.box.post(op, request, rank=rank)
            self.llm.init_weight_transfer_engine({"init_info": info})
            return self.box.replies(info, range(self.tp_size) if rank < 0 else [rank])

    def setup(self, request: SetupRequest) -> list[EngineRankMeta]:
        """Register every rank's memory; one EngineRankMeta per TP rank, in rank order."""
        return self.call("setup", request)

    # ------------------------------------------------------------------ updates

    def pause(self, timeout_s: float = 60.0) -> None:
        """Stop at a step boundary and open vLLM's update session (idempotent)."""
        self.gate.pause(timeout_s)
        if not self._updating:
            self.llm.start_weight_update()
            self._updating = True

    def resume(self, version: Any = None) -> None:
        """Close the update session (vLLM reprocesses repacked layers), record ``version``,
        reset the prefix cache and let steps run again."""
        if self._updating:
            self.llm.finish_weight_update(
                weight_version=None if version is None else str(version))
            self._updating = False
        elif version is not None:
            self.llm.update_weight_version(str(version))
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            log.warning("vLLM did not reset its prefix cache after version %s", version)
        self.gate.resume()

    def set_version(self, version: Any) -> None:
        self.llm.update_weight_version("none" if version is None else str(version))

    def version(self) -> str:
        return self.llm.get_weight_version()

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
        """Generations from token ids (greedy unless ``temperature`` > 0, then sampled by
        vLLM, request ``i`` seeded ``seed + i``), one engine step at a time (see StepGate)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        ids = [f"wt-{next(self._ids)}" for _ in prompts]
        for i, (rid, p) in enumerate(zip(ids, prompts, strict=True)):
            params = SamplingParams(  # one seed per request: equal seeds draw alike
                temperature=temperature, seed=None if seed is None else seed + i,
                max_tokens=max_new_tokens, detokenize=False)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params)
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            for out in self.gate.step(engine.step):
                if out.finished and out.request_id in ids:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return [done[r] for r in ids]

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.box.close()
