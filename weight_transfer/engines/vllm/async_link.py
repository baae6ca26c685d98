"""Driver side of our backend in a user's ``AsyncLLM``, from a thread beside its event loop.

The ``AsyncLLM`` lives in the user's async actor (verl's agent loop, SkyRL):
its requests stream on the actor's event loop. The controller's calls are
blocking, so they run in a worker thread and submit vLLM's coroutines to that
loop (``asyncio.run_coroutine_threadsafe``); the loop keeps serving requests::

    link = AsyncLink(engine, pause_mode="keep")      # engine: AsyncLLM(... wt_onesided)
    link.loop = asyncio.get_running_loop()           # in the actor, before the first call
    await asyncio.to_thread(link.pause)              # pause_generation(mode="keep"),
                                                     # start_weight_update
    await asyncio.to_thread(link.resume, 7)          # finish_weight_update("7"), prefix
                                                     # cache reset, resume_generation

The same interface as :class:`~weight_transfer.engines.vllm.driver.VllmLink`;
requests and replies of our backend travel through the mailbox directory (the
engine's workers run on this host). A LoRA adapter
(:class:`~weight_transfer.engines.vllm.lora.link.LoraLink`) works over it as over a
``VllmLink``: its flip runs at :meth:`AsyncLink.at_step_boundary` (vLLM's
``pause_generation(mode="keep")``, the swap, a prefix-cache reset,
``resume_generation``) while the actor's requests stay queued, and
``generate(..., lora_request=)`` runs under an adapter.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from weight_transfer.engines.vllm.driver import TokensOfTagged, request_params, timed_boundary
from weight_transfer.engines.vllm.http_link import PAUSE_MODES, PauseFlag
from weight_transfer.engines.vllm.mailbox import Mailbox, SetupRequest
from weight_transfer.sync.versions import Generation, from_vllm
from weight_transfer.types import EngineRankMeta

log = logging.getLogger(__name__)


class AsyncLink(TokensOfTagged):
    """Our backend in every worker of one ``AsyncLLM``; see the module docstring."""

    def __init__(self, engine: Any, *, pause_mode: str = "keep", recompute: bool = True,
                 timeout_s: float = 600.0) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r}: one of {', '.join(PAUSE_MODES)}")
        self.engine, self.pause_mode, self.recompute = engine, pause_mode, recompute
        self.tp_size = engine.vllm_config.parallel_config.tensor_parallel_size
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timeout_s = timeout_s
        self.box = Mailbox.create()
        self.gate = PauseFlag()
        self._updating = False
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the engine's loop from this (another) thread; its result."""
        if self.loop is None:
            coro.close()
            raise RuntimeError("AsyncLink.loop is not set: set it to the AsyncLLM's event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def call(self, op: str, request: Any = None, *, rank: int = -1) -> list[Any]:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        with self._lock:
            info = self.box.post(op, request, rank=rank)
            self.run(self.engine.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=info)))
            return self.box.replies(info, range(self.tp_size) if rank < 0 else [rank])

    def setup(self, request: SetupRequest) -> list[EngineRankMeta]:
        return self.call("setup", request)

    def pause(self, timeout_s: float = 60.0) -> None:
        """vLLM's ``pause_generation(mode=pause_mode)``, then its update session."""
        if not self.gate.paused:
            self.run(self.engine.pause_generation(mode=self.pause_mode))
            self.gate.paused = True
        if not self._updating:
            self.run(self.engine.start_weight_update())
            self._updating = True

    def resume(self, version: Any = None) -> None:
        if self._updating:
            self.run(self.engine.finish_weight_update(
                None if version is None else str(version)))
            self._updating = False
        elif version is not None:
            self.set_version(version)
        self._reset_prefix_cache(version)
        self._resume_generation()

    def at_step_boundary(self, fn: Callable[[], None], version: Any = None) -> float:
        """``fn`` with vLLM's scheduler paused in mode ``keep`` (a step boundary: requests
        stay queued, none is dropped), then the prefix cache reset; the engine serves
        afterwards. Returns the seconds paused; ``version``: for the log only."""
        if self._updating:
            raise ValueError("at_step_boundary: a full-weight update is in progress "
                             "(resume it first)")

        def stop() -> None:
            self.run(self.engine.pause_generation(mode="keep"))
            self.gate.paused = True

        return timed_boundary(fn, stop=stop, reset=lambda: self._reset_prefix_cache(version),
                              go=self._resume_generation)

    def _reset_prefix_cache(self, version: Any) -> None:
        if not self.run(self.engine.reset_prefix_cache(reset_running_requests=self.recompute)):
            log.warning("AsyncLLM did not reset its prefix cache after version %s", version)

    def _resume_generation(self) -> None:
        self.run(self.engine.resume_generation())
        self.gate.paused = False

    def set_version(self, version: Any) -> None:
        self.run(self.engine.update_weight_version("none" if version is None else str(version)))

    def version(self) -> str:
        return self.run(self.engine.get_weight_version())

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        """vLLM's ``collective_rpc``: ``method`` (a worker method's name, or a callable with
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) in every worker; their results."""
        return self.run(self.engine.collective_rpc(method, args=args))

    def generate_tagged(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                        temperature: float = 0.0, seed: int | None = None,
                        lora_request: Any = None,
                        on_step: Callable[[int, int, float | None], None] | None = None
                        ) -> list[Generation]:
        """:meth:`generate`, each with vLLM's own ``weight_versions`` spans. ``on_step(i, n,
        stamp)`` (on the engine's loop): after each output of prompt ``i``, ``n`` tokens so
        far, ``stamp`` the engine step's timestamp (host-wide monotonic) when vLLM logs
        stats, else the arrival time. An output may carry several steps' tokens when the
        loop is busy: they take the last step's stamp."""
        from vllm.inputs import TokensPrompt

        async def one(i: int, prompt: Sequence[int]) -> Generation:
            last = None
            async for out in self.engine.generate(
                    TokensPrompt(prompt_token_ids=list(prompt)),
                    request_params(i, max_new_tokens, temperature, seed),
                    f"wt-{next(self._ids)}", lora_request=lora_request):
                last = out
                if on_step is not None and out.outputs:
                    on_step(i, len(out.outputs[0].token_ids), step_stamp(out))
            c = last.outputs[0]
            return from_vllm(c.token_ids, c.weight_versions)

        async def all_of() -> list[Generation]:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        return self.run(all_of())

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.box.close()


def step_stamp(output: Any) -> float:
    """The engine-step timestamp of a ``RequestOutput``'s latest token (vLLM's, host-wide
    monotonic; kept in its request stats when stats are logged), else now."""
    stamp = getattr(getattr(output, "metrics", None), "last_token_ts", 0.0)
    return float(stamp) if stamp else time.monotonic()
