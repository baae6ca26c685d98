"""Driver side of a served LoRA adapter: set up, begin, flip, roll back (beside a VllmLink
of an offline ``LLM`` or an AsyncLink of an ``AsyncLLM``: the link's ``call``, ``version``,
``at_step_boundary`` and ``generate_tagged`` are all it uses).

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
import time
from collections.abc import Sequence
from typing import Any

from weight_transfer.engines.vllm.lora.spec import AdapterSpec, LoraRankMeta, LoraSetup
from weight_transfer.sync.versions import Generation, VersionSpan, parse_version

log = logging.getLogger(__name__)


def _spans(marks: list[tuple[int, str | None]], ntokens: int) -> tuple[VersionSpan, ...]:
    """Version spans from (the first token a version made, that version), in order."""
    spans: list[VersionSpan] = []
    for start, version in marks:
        v = parse_version(version)
        if start < ntokens and (not spans or spans[-1].version != v):
            spans.append(VersionSpan(version=v, start=start))
    return tuple(spans)


PLACEHOLDER_PATH = "wt-onesided://{name}"  # LoRARequest needs a path; vLLM never reads it


class LoraLink:
    """One served adapter of one engine (through its :class:`..driver.VllmLink` or
    :class:`..async_link.AsyncLink`)."""

    def __init__(self, link: Any, *, name: str, lora_int_id: int = 1) -> None:
        if lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (vLLM's rule), not {lora_int_id}")
        self.link, self.name, self.lora_int_id = link, name, lora_int_id
        self.version: str | None = None  # the adapter version served
        self.previous: str | None = None  # the one a rollback returns to
        self._writing = False
        self.served: list[tuple[float, str | None]] = []  # (monotonic, version) per flip

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
            self._served()

        return self.link.at_step_boundary(swap, version)

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
            self._served()

        return self.link.at_step_boundary(back, self.previous)

    def _served(self) -> None:
        """Log the version served from now (vLLM's scheduler is paused: every step stamped
        before this instant ran the version before, every one after it this one)."""
        self.served.append((time.monotonic(), self.version))

    def version_at(self, stamp: float | None) -> str | None:
        """The adapter version served at vLLM's step timestamp ``stamp``."""
        at = None
        for t, version in self.served:
            if stamp is None or t > stamp:
                break
            at = version
        return at

    def generate_tagged(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        **kw: Any) -> list[Generation]:
        """Generations under this adapter (greedy unless ``temperature``), each with the
        adapter versions that produced its tokens: spans as in vLLM's ``weight_versions``,
        from the steps' own timestamps against the flips (a request that a flip overtook
        has two). Only this thread may generate on the engine meanwhile."""
        marks: list[list[tuple[int, str | None]]] = [[] for _ in prompts]
        made = [0] * len(prompts)  # tokens per request before the step just taken
        chained = kw.pop("on_step", None)

        def on_step(i: int, n: int, stamp: float | None) -> None:
            version = self.version_at(stamp)
            if not marks[i] or marks[i][-1][1] != version:
                marks[i].append((made[i], version))
            made[i] = n
            if chained is not None:
                chained(i, n, stamp)

        gens = self.link.generate_tagged(prompts, max_new_tokens, lora_request=self.request(),
                                         on_step=on_step, **kw)
        return [Generation(tokens=g.tokens, spans=_spans(m, len(g.tokens)))
                for g, m in zip(gens, marks, strict=True)]

    def close(self) -> None:
        self.link.call("lora_close", self.name)
