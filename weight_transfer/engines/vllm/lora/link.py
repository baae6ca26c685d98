"""Driver side of a served LoRA adapter: set up, begin, flip, roll back (beside a VllmLink).

::

    link = VllmLink(llm)                        # LLM(..., enable_lora=True, max_loras=2+)
    link.setup(SetupRequest(...))               # full weights (its NICs are shared)
    lora = LoraLink(link, name="policy", lora_int_id=1)
    metas = lora.setup(describe_peft(peft_model), nics=(("inode0/nic0",),))
    request = lora.request()                    # vLLM's LoRARequest("policy", 1, ...)
    slot = lora.begin(base_version=watch.check())  # the free slot; the engine keeps serving
    ...                                         # the trainers write that slot one-sided
    lora.flip(version=3)                        # step boundary: "policy" -> the new slot
    lora.rollback()                             # step boundary: back to the version before
    lora.discard()                              # instead of flip: a failed transfer

Engine code runs at setup and at the step boundary of a flip or a rollback (vLLM's
scheduler paused with ``keep``, as at a shadow flip; the prefix cache is reset, so no
KV computed with the previous version is reused); never while the trainers write.
The user's ``LoRARequest`` name and id stay the same across versions; its path is a
placeholder vLLM never reads (the id is loaded and pinned by us). vLLM drops every
adapter after a full-weight update: write and flip the adapter again after one (the
next ``begin`` takes the slots again); until then requests under the name fail.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from weight_transfer.engines.vllm.lora.spec import AdapterSpec, LoraRankMeta, LoraSetup

log = logging.getLogger(__name__)

PLACEHOLDER_PATH = "wt-onesided://{name}"  # LoRARequest needs a path; vLLM never reads it


class LoraLink:
    """One served adapter of one ``LLM`` (through its :class:`..driver.VllmLink`)."""

    def __init__(self, link: Any, *, name: str, lora_int_id: int = 1) -> None:
        if lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (vLLM's rule), not {lora_int_id}")
        self.link, self.name, self.lora_int_id = link, name, lora_int_id
        self.version: str | None = None  # the adapter version served
        self.previous: str | None = None  # the one a rollback returns to
        self._writing = False

    def setup(self, adapter: AdapterSpec, *, nics: Sequence[Sequence[str]], replica: str = "",
              transport: Any = None, node: str = "", address: str = "") -> list[LoraRankMeta]:
        """Own two slots in every worker and record them; one LoraRankMeta per TP rank.
        ``nics`` per TP rank: the full-weight setup's NICs to share its connections."""
        req = LoraSetup(adapter=adapter, name=self.name, lora_int_id=self.lora_int_id,
                        replica=replica or "engine0", nics=tuple(tuple(n) for n in nics),
                        transport=transport, node=node, address=address)
        return self.link.call("lora_setup", req)

    def request(self) -> Any:
        """The ``LoRARequest`` users send: the same name and id for every version."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_int_id,
                           PLACEHOLDER_PATH.format(name=self.name))

    def begin(self, base_version: Any = None) -> int:
        """The slot the trainers write the next version into (the same on every rank); the
        engine keeps serving the current version. The previous one is no rollback target.
        ``base_version``: the base weights' version the adapter was trained on
        (:meth:`weight_transfer.sources.lora.BaseWatch.check`); refused, with nothing
        begun, unless the engine serves that base version."""
        if base_version is not None:
            served = self.link.version()
            if str(base_version) != served:
                raise ValueError(
                    f"adapter {self.name!r}: this update was trained on base version "
                    f"{base_version}, the engine serves base version {served}: update the "
                    "base weights first (a full-weight update), then the adapter")
        if self._writing:
            raise ValueError(f"adapter {self.name!r}: an update is already being written "
                             "(flip it first)")
        slots = set(self.link.call("lora_begin", self.name))
        if len(slots) != 1:
            raise RuntimeError(f"adapter {self.name!r}: TP ranks disagree on the free slot "
                               f"{sorted(slots)}")
        self._writing = True
        return slots.pop()

    def flip(self, version: Any = None) -> float:
        """At a step boundary the adapter's name serves the version just written; returns
        the seconds the engine's scheduler was paused."""
        if not self._writing:
            raise ValueError(f"adapter {self.name!r}: flip without begin")

        def swap() -> None:
            self.link.call("lora_flip", self.name)
            self._writing = False
            self.previous, self.version = self.version, None if version is None else str(version)

        return self.link._paused(swap, version)

    def discard(self) -> None:
        """End the update being written without a flip (a failed transfer); the engine
        serves the current version throughout."""
        self.link.call("lora_discard", self.name)
        self._writing = False
        self.previous = None

    def rollback(self) -> float:
        """At a step boundary: back to the version before the last flip (one step)."""
        def back() -> None:
            self.link.call("lora_rollback", self.name)
            self.version, self.previous = self.previous, None

        return self.link._paused(back, self.previous)

    def close(self) -> None:
        self.link.call("lora_close", self.name)
