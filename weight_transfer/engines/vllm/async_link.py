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
engine's workers run on this host).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

from weight_transfer.engines.vllm.http_link import PAUSE_MODES, PauseFlag
from weight_transfer.engines.vllm.mailbox import Mailbox, SetupRequest
from weight_transfer.types import EngineRankMeta

log = logging.getLogger(__name__)


class AsyncLink:
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
        if not self.run(self.engine.reset_prefix_cache(reset_running_requests=self.recompute)):
            log.warning("AsyncLLM did not reset its prefix cache after version %s", version)
        self.run(self.engine.resume_generation())
        self.gate.paused = False

    def set_version(self, version: Any) -> None:
        self.run(self.engine.update_weight_version("none" if version is None else str(version)))

    def version(self) -> str:
        return self.run(self.engine.get_weight_version())

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
        """Generations from token ids (greedy unless ``temperature`` > 0), all at once."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        async def one(i: int, prompt: Sequence[int]) -> list[int]:
            params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                                    seed=None if seed is None else seed + i, detokenize=False)
            last = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(prompt)),
                                                  params, f"wt-{next(self._ids)}"):
                last = out
            return list(last.outputs[0].token_ids)

        async def all_of() -> list[list[int]]:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        return self.run(all_of())

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.box.close()
