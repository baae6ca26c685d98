"""The engine-rank contract: every method the controller (and the tools) call on an engine
rank's actor, whatever the engine.

An engine rank is one (replica, TP rank) actor. The reference engine's
(:class:`actors.inference.InferenceMixin`) and vLLM's facade
(:class:`actors.vllm_engine.VllmRankFacade`) implement :class:`EngineRank`
with one shared implementation underneath: :class:`~.fence.CommandFence` (epochs,
version held, events) and :class:`~.registered.RegisteredMemory` (NICs, regions,
connection set-up, peer copy, checksums, statistics).

The controller names a method by its protocol member, never by a string, so
a misspelt name fails where it is written::

    fan_out(ledger, replicas, names, EngineRank.wt_pause, timeout_s, epoch=e, until=t)
    method_name(EngineRank.wt_pause)    # "wt_pause"; TypeError for anything else
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from weight_transfer.types import EngineRankMeta, PeerInfo


@runtime_checkable
class EngineRank(Protocol):
    """One engine rank as the controller sees it (the methods of its actor)."""

    # ---- set-up: registered memory and connections
    def wt_engine_meta(self, transport: Any = None) -> EngineRankMeta:
        """Register the engine's buffers once (NICs of ``transport``); describe them."""

    def wt_host(self) -> Any:
        """The host this rank runs on (a ``HostId``)."""

    def wt_node_id(self) -> str:
        """The Ray node this rank runs on."""

    def wt_endpoints(self, requests: list) -> tuple[PeerInfo, ...]:
        """Connection set-up, round 1: peer info per remote NIC named."""

    def wt_connect_peers(self, conns: list) -> int:
        """Connection set-up, round 2: connect to the peer infos made for these NICs."""

    # ---- an update: fenced commands (see weight_transfer.engines.fence)
    def wt_pause(self, timeout_s: float = 60.0, epoch: int | None = None) -> bool:
        """Hold generation at a step boundary; False: a stale command, ignored."""

    def wt_resume(self, version: Any = ..., epoch: int | None = None,
                  deadline: float | None = None) -> bool:
        """Record ``version`` (``KEEP``: the one held stays) and serve; False: stale or late."""

    def wt_set_version(self, version: Any, epoch: int | None = None) -> bool:
        """Record the version held without a pause; False: stale."""

    def wt_version(self) -> Any:
        """The version held (None: torn or unknown)."""

    def wt_paused(self) -> bool:
        """Whether generation is held."""

    def wt_events(self) -> list[tuple[str, Any, float]]:
        """(event, version held, time.time()) of the latest pauses, resumes and versions."""

    # ---- checks, peers, statistics
    def wt_checksum(self, ranges: np.ndarray) -> np.ndarray:
        """XXH3-64 of (region addr, offset, length) rows of the registered memory."""

    def wt_copy_to(self, dst: EngineRankMeta) -> int:
        """Write the registered memory into another replica's rank (same layout); bytes."""

    def wt_nic_stats(self) -> dict[str, int]:
        """Bytes and writes the rank's NICs sent."""

    def wt_transport(self) -> str | None:
        """The transport kind of the rank's NICs, once open."""

    def wt_close(self) -> None:
        """Close the rank's NICs (the next ``wt_engine_meta`` registers again)."""


ENGINE_RANK_METHODS: frozenset[str] = frozenset(
    name for name in vars(EngineRank) if name.startswith("wt_"))


def method_name(member: Callable[..., Any]) -> str:
    """The name of an :class:`EngineRank` member (``EngineRank.wt_pause`` -> "wt_pause");
    TypeError for anything else (a string, another class's method)."""
    name = getattr(member, "__name__", None)
    if name not in ENGINE_RANK_METHODS or getattr(EngineRank, name) is not member:
        raise TypeError(f"expected a member of EngineRank (one of "
                        f"{sorted(ENGINE_RANK_METHODS)}), got {member!r}")
    return name
