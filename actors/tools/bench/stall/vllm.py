"""``wt bench stall --engine vllm``: the client that generates on a vLLM replica, and its steps.

vLLM's engine core steps its running requests in its own process; every batch
of outputs it sends carries vLLM's timestamp (the host-wide monotonic clock),
which :class:`~weight_transfer.engines.vllm.driver.StepClock` keeps and the
owner actor returns in wall-clock time (``VllmEngineOwner.step_times``). So a
step here is one vLLM engine step that produced tokens, and a stall is vLLM's
own: the pause of an in-place update (scheduler paused from before the writes
to after the reprocessing) or the flip of a shadow update.

Requests are greedy, ``max_new_tokens`` long, one batch after another per
replica (the bench's client loop), so the engine always has work.
"""

from __future__ import annotations

from typing import Any

import ray

from actors.tools.demo.fleet import token_batch


class VllmStallClient:
    """Requests on a vLLM replica (through its rank-0 facade) and its engine's step times."""

    def __init__(self, fleet: Any, *, prompt_len: int = 8, max_new_tokens: int = 32) -> None:
        cfg = fleet.config.model
        self.replicas, self.max_new_tokens = fleet.replicas, max_new_tokens
        self.owners = dict(zip(fleet.replicas, fleet.owners, strict=True))
        self.prompts = token_batch(cfg.vocab_size, 2, prompt_len, seed=7)

    def generate(self, replica: str) -> None:
        ray.get(self.replicas[replica][0].generate.remote(self.prompts, self.max_new_tokens))

    def step_times(self, replica: str, since: float) -> list[float]:
        return ray.get(self.owners[replica].step_times.remote(since))
