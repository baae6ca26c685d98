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
    link.generate_tagged(...)    # each sequence with the versions of its tokens (vLLM's spans)

Shadow mode (``SetupRequest(apply="shadow")``, :mod:`.shadow`): the engine serves
throughout the transfer and pauses for the flip alone::

    link.begin()                 # start_weight_update while serving (the standby is saved)
    ...                          # the trainers write the shadow; the integrity check
    link.flip(version=8)         # pause at a step boundary, finish_weight_update (the flip),
                                 # version, prefix-cache reset, serve again
    link.rollback()              # the version before the last flip, in one flip
    link.discard()               # instead of flip: a failed transfer never touches live memory

``link.at_step_boundary(fn)`` runs ``fn`` there alone (a LoRA adapter's flip, :mod:`.lora`);
:class:`~weight_transfer.engines.vllm.async_link.AsyncLink` has the same for an ``AsyncLLM``.

``generate`` runs vLLM's engine loop itself, one ``step()`` at a time, and
checks the gate before each step. vLLM's engine core steps its running
requests on its own (in its process), so ``pause`` also pauses vLLM's
scheduler (``pause_scheduler("keep")``: no request is scheduled, none is
dropped) and returns at a step boundary. At ``resume`` and at a flip the
prefix cache is reset with ``reset_running_requests=True``, so no KV computed
with the old weights is reused (those requests are recomputed).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from weight_transfer.engines.vllm.mailbox import Mailbox, SetupRequest
from weight_transfer.sync.versions import Generation, from_vllm
from weight_transfer.types import EngineRankMeta

log = logging.getLogger(__name__)

# A small engine for tests and the demo: prompts as token ids, no CUDA graphs, little KV.
SMALL_ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                    kv_cache_memory_bytes=32 << 20)
# vLLM's executor that runs the model inside the engine core's process, named by class.
# It is vLLM's default at TP1 on GPU; vLLM's CPU platform turns "uni" into "mp" (a worker
# process of its own even at TP1) but keeps an executor named by class. So a TP1 engine is
# two processes (the caller's and the engine core's) here as on GPU, not three: about 8 s
# and 8 CPU-s less per engine start on the 2-core machines, the same tokens.
IN_CORE_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def request_params(i: int, max_new_tokens: int, temperature: float, seed: int | None) -> Any:
    """vLLM's ``SamplingParams`` of request ``i`` of a batch: token ids out (no detokenizer),
    greedy unless ``temperature`` > 0, then seeded ``seed + i`` (equal seeds draw alike)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, seed=None if seed is None else seed + i,
                          max_tokens=max_new_tokens, detokenize=False)


def timed_boundary(fn: Callable[[], None], *, stop: Callable[[], None],
                   reset: Callable[[], None], go: Callable[[], None]) -> float:
    """``stop()`` (vLLM's scheduler paused, requests kept), ``fn()``, ``reset()`` (the prefix
    cache), then ``go()`` whatever happened; the seconds from the stop to serving again."""
    t0 = time.perf_counter()
    stop()
    try:
        fn()
        reset()
    finally:
        go()
    return time.perf_counter() - t0


class TokensOfTagged:
    """``generate`` of a link that has ``generate_tagged``: the tokens alone."""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None,
                 lora_request: Any = None) -> list[list[int]]:
        """Generations from token ids (greedy unless ``temperature`` > 0, then sampled by
        vLLM, request ``i`` seeded ``seed + i``); ``lora_request``: vLLM's ``LoRARequest``
        of an adapter to run with."""
        return [list(g.tokens) for g in self.generate_tagged(  # type: ignore[attr-defined]
            prompts, max_new_tokens, temperature=temperature, seed=seed,
            lora_request=lora_request)]


def executor_for(tp: int) -> str:
    """vLLM's ``distributed_executor_backend`` for ``tp`` ranks: a worker process per rank
    above one, the model in the engine core at one (:data:`IN_CORE_EXECUTOR`)."""
    return "mp" if tp > 1 else IN_CORE_EXECUTOR


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


class StepClock:
    """When vLLM's engine core produced tokens: the (monotonic, host-wide) timestamp vLLM
    puts on each batch of outputs, one per engine step; the latest ``kept``."""

    def __init__(self, kept: int = 1 << 16) -> None:
        self._times: deque[float] = deque(maxlen=kept)
        self.count = 0

    def record(self, outputs: Any) -> Any:
        if getattr(outputs, "outputs", None):
            self._times.append(float(outputs.timestamp))
            self.count += 1
        return outputs

    @property
    def last(self) -> float | None:
        """The latest step's timestamp (None before any)."""
        return self._times[-1] if self._times else None

    def times(self, since: float = 0.0) -> list[float]:
        return [t for t in list(self._times) if t >= since]


class VllmLink(TokensOfTagged):
    """Our backend in every worker of one ``LLM``; see the module docstring."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.tp_size = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        self.box = Mailbox.create()
        self.gate = StepGate()
        self.apply = "in_place"  # set by setup
        self.previous: str | None = None  # shadow: the version label a rollback returns to
        self._updating = False
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one backend operation at a time
        self._send = threading.Lock()  # vLLM's client socket: one sender at a time
        self.clock = StepClock()
        core = llm.llm_engine.engine_core
        receive = core.get_output  # every engine step's outputs pass here: time them
        core.get_output = lambda: self.clock.record(receive())

    def call(self, op: str, request: Any = None, *, rank: int = -1) -> list[Any]:
        """Run ``op`` in the worker of TP rank ``rank`` (-1: every rank); their replies."""
        with self._lock:
            info = self.box.post(op, request, rank=rank)
            with self._send:
                self.llm.init_weight_transfer_engine({"init_info": info})
            return self.box.replies(info, range(self.tp_size) if rank < 0 else [rank])

    def _vllm(self, method: str, *args: Any, **kw: Any) -> Any:
        """One of the ``LLM``'s own calls (it sends on the engine client's socket)."""
        with self._send:
            return getattr(self.llm, method)(*args, **kw)

    def setup(self, request: SetupRequest) -> list[EngineRankMeta]:
        """Register every rank's memory; one EngineRankMeta per TP rank, in rank order."""
        metas = self.call("setup", request)
        self.apply = request.apply
        return metas

    # ------------------------------------------------------------------ updates

    def pause(self, timeout_s: float = 60.0) -> None:
        """Stop at a step boundary and open vLLM's update session (idempotent)."""
        self.gate.pause(timeout_s)
        self._scheduler(pause=True)
        if not self._updating:
            self._vllm("start_weight_update")
            self._updating = True

    def resume(self, version: Any = None) -> None:
        """Close the update session (vLLM reprocesses repacked layers; shadow mode: the
        flip), record ``version``, reset the prefix cache and let steps run again."""
        try:
            if self._updating:
                self._finish(version)
            elif version is not None:
                self._vllm("update_weight_version", str(version))
            self._reset_prefix_cache(version)
        finally:
            self._scheduler(pause=False)
            self.gate.resume()

    def begin(self) -> None:
        """Shadow mode: open vLLM's update session while the engine serves (the worker saves
        the version served for a rollback; the trainers then write the shadow)."""
        self._require_shadow("begin")
        if self._updating:
            raise ValueError("begin: a transfer is already in flight (flip or discard it)")
        self._vllm("start_weight_update")
        self._updating = True

    def flip(self, version: Any = None) -> float:
        """Shadow mode: at a step boundary, live memory receives the shadow (vLLM's
        finish_weight_update), ``version`` is recorded, the prefix cache reset; the engine
        serves again. Returns the seconds the engine was paused."""
        self._require_shadow("flip")
        if not self._updating:
            raise ValueError("flip: no transfer in progress (call begin first)")
        return self.at_step_boundary(lambda: self._finish(version), version)

    def discard(self) -> None:
        """Shadow mode: end the transfer in progress without a flip; live memory is
        untouched and the engine never paused."""
        self._require_shadow("discard")
        if not self._updating:
            raise ValueError("discard: no transfer in progress")
        self.call("discard")
        self._vllm("finish_weight_update")
        self._updating = False
        self.previous = None  # the worker's standby now holds the version served

    def rollback(self, version: Any = None) -> float:
        """Shadow mode: back to the version before the last flip, in one flip (``version``:
        its label; default: the label it had). Returns the seconds paused."""
        self._require_shadow("rollback")
        if self._updating:
            raise ValueError("rollback: a transfer is in flight (flip or discard it first)")
        label = self.previous if version is None else str(version)

        def back() -> None:
            current = self.version()
            self.call("rollback")
            self._vllm("update_weight_version", "none" if label is None else label)
            self.previous = current

        return self.at_step_boundary(back, label)

    def at_step_boundary(self, fn: Callable[[], None], version: Any = None) -> float:
        """``fn`` with vLLM's scheduler paused (a step boundary, requests kept), then the
        prefix cache reset; the engine serves afterwards (also one held by :meth:`pause`
        before). Returns the seconds paused; ``version``: for the log only."""
        def go() -> None:
            self._scheduler(pause=False)
            self.gate.resume()

        return timed_boundary(fn, stop=lambda: self._scheduler(pause=True),
                              reset=lambda: self._reset_prefix_cache(version), go=go)

    def _finish(self, version: Any) -> None:
        current = self.version()
        self._updating = False  # vLLM ends the session even when the finish raises
        self._vllm("finish_weight_update",
                   weight_version=None if version is None else str(version))
        self.previous = current

    def _reset_prefix_cache(self, version: Any) -> None:
        if not self._vllm("reset_prefix_cache", reset_running_requests=True):
            log.warning("vLLM did not reset its prefix cache after version %s", version)

    def _scheduler(self, *, pause: bool) -> None:
        """Pause (``keep``: requests stay) or resume vLLM's scheduler in its engine core; an
        in-process engine core steps only when generate() asks (the gate holds it)."""
        core = self.llm.llm_engine.engine_core
        if hasattr(core, "call_utility"):
            with self._send:
                if pause:
                    core.call_utility("pause_scheduler", "keep", False)
                else:
                    core.call_utility("resume_scheduler")

    def _require_shadow(self, what: str) -> None:
        if self.apply != "shadow":
            raise ValueError(f"{what} needs apply='shadow' (the engine was set up with "
                             f"apply={self.apply!r})")

    @property
    def updating(self) -> bool:
        """Whether vLLM's update session is open (a transfer may be in flight)."""
        return self._updating

    def memory(self) -> list[dict[str, int]]:
        """Per TP rank, the bytes of each copy kept (arena, shadow, standby)."""
        return self.call("memory")

    def set_version(self, version: Any) -> None:
        self._vllm("update_weight_version", "none" if version is None else str(version))

    def version(self) -> str:
        return self._vllm("get_weight_version")

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        """vLLM's ``collective_rpc``: ``method`` (a worker method's name, or a callable with
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) in every worker; their results."""
        return self._vllm("collective_rpc", method, args=args)

    # ------------------------------------------------------------------ generation

    def generate_tagged(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                        temperature: float = 0.0, seed: int | None = None,
                        lora_request: Any = None,
                        on_step: Callable[[int, int, float | None], None] | None = None
                        ) -> list[Generation]:
        """:meth:`generate`, one engine step at a time (see StepGate), each sequence with the
        weight versions that produced its tokens (vLLM's own per-span ``weight_versions``).
        ``on_step(i, n, stamp)``: after each engine step that gave prompt ``i`` tokens, ``n``
        of them so far, ``stamp`` vLLM's timestamp of that step (host-wide monotonic; exact
        while one thread generates)."""
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        ids = [f"wt-{next(self._ids)}" for _ in prompts]
        for i, (rid, p) in enumerate(zip(ids, prompts, strict=True)):
            params = request_params(i, max_new_tokens, temperature, seed)
            with self._send:
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params,
                                   lora_request=lora_request)
        index = {rid: i for i, rid in enumerate(ids)}
        done: dict[str, Generation] = {}
        while len(done) < len(ids):
            for out in self.gate.step(engine.step):
                if on_step is not None and out.request_id in index and out.outputs:
                    on_step(index[out.request_id], len(out.outputs[0].token_ids),
                            self.clock.last)
                if out.finished and out.request_id in ids:
                    c = out.outputs[0]
                    done[out.request_id] = from_vllm(c.token_ids, c.weight_versions)
        return [done[r] for r in ids]

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.box.close()
