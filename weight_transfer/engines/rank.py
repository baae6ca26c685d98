"""The engine-rank contract: every method the controller (and the tools) call on an engine
rank's actor, whatever the engine.

An engine rank is one (replica, TP rank). The reference engine's actors
(:class:`actors.inference.InferenceMixin`) implement :class:`EngineRank`; for vLLM
the replica's owner actor (:class:`actors.vllm.engine.VllmEngineOwner`) does, for
the rank its plain :class:`~actors.vllm.engine.VllmRank` handle names first; with one
shared implementation underneath: :class:`~.fence.CommandFence` (epochs,
version held, events) and :class:`~.registered.RegisteredMemory` (NICs, regions,
connection set-up, peer copy, checksums, statistics).

The controller names a method by its protocol member, never by a string, so
a misspelt name fails where it is written::

    fan_out(ledger, replicas, names, EngineRank.wt_pause, timeout_s, epoch=e, until=t)
    method_name(EngineRank.wt_pause)    # "wt_pause"; TypeError for anything else

Engines that can keep a second copy of their weights also implement
:class:`ShadowEngineRank` (shadow mode: stage, flip, rollback, discard).
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
        """Write the version this rank holds (in shadow mode: its live memory) into another
        replica's rank's registered memory (same layout); bytes."""

    def wt_nic_stats(self) -> dict[str, int]:
        """Bytes and writes the rank's NICs sent."""

    def wt_transport(self) -> str | None:
        """The transport kind of the rank's NICs, once open."""

    def wt_close(self) -> None:
        """Close the rank's NICs (the next ``wt_engine_meta`` registers again)."""


@runtime_checkable
class ShadowEngineRank(EngineRank, Protocol):
    """An engine rank that can run shadow mode (``TransferConfig.apply="shadow"``): a second
    copy of its weights that updates write while it serves, a flip at a step boundary,
    and a rollback that is one more flip (:mod:`weight_transfer.engines.shadow.store`). An engine
    without these methods is refused shadow mode at setup, naming the engine.

    Every command is fenced by the controller's epoch like a pause (a stale one returns
    False and changes nothing); a refused transition raises ``ShadowError`` (a
    ValueError) naming the rank and what the shadow holds, and changes nothing."""

    def wt_shadow_setup(self, transport: Any = None) -> Any:
        """Allocate the shadow (a second copy of every tensor the engine computes with) and
        register it instead of the live memory: from now on ``wt_engine_meta`` describes
        the shadow's regions and the plan writes there. Returns a ``ShadowInfo`` (bytes);
        ``ShadowError`` naming the engine where it cannot hold a second copy."""

    def wt_shadow_info(self) -> Any:
        """What the shadow holds now (a ``ShadowInfo``; ShadowError: no shadow)."""

    def wt_stage(self, version: Any, epoch: int | None = None, base: bool = False) -> bool:
        """A transfer of ``version`` starts writing the shadow (the engine keeps serving its
        live memory; the previous version kept in the shadow is dropped); False: stale.
        ``base``: a sparse delta update follows, whose records name the version served as
        their base: the registered (written) memory must hold the live version's bytes
        first (the reference engine copies live into the shadow; vLLM's registered memory
        holds them already)."""

    def wt_flip(self, version: Any, epoch: int | None = None,
                deadline: float | None = None) -> bool:
        """At the next step boundary swap live and shadow (the shadow, staged with
        ``version`` and complete, becomes live; the version served before stays in the
        shadow), reset caches, hold ``version``. ShadowError when the shadow was not
        staged with ``version``; False: stale or late."""

    def wt_rollback(self, epoch: int | None = None, deadline: float | None = None) -> bool:
        """Flip back to the previous version (kept in the shadow by the last flip).
        ShadowError when there is none; False: stale or late."""

    def wt_discard_shadow(self, epoch: int | None = None) -> bool:
        """The transfer into the shadow failed: it holds nothing complete; live memory and
        the version held are untouched. False: stale."""

    def wt_live_checksum(self, ranges: np.ndarray) -> np.ndarray:
        """``wt_checksum`` of the same rows in the memory the engine computes with (shadow
        mode: the live copy at the same offsets; in place: the registered memory)."""


ENGINE_RANK_METHODS: frozenset[str] = frozenset(
    name for name in vars(EngineRank) if name.startswith("wt_"))
SHADOW_RANK_METHODS: frozenset[str] = frozenset(
    name for name in vars(ShadowEngineRank) if name.startswith("wt_"))


def method_name(member: Callable[..., Any]) -> str:
    """The name of an :class:`EngineRank` or :class:`ShadowEngineRank` member
    (``EngineRank.wt_pause`` -> "wt_pause"); TypeError for anything else (a string,
    another class's method)."""
    name = getattr(member, "__name__", None)
    owner = EngineRank if name in ENGINE_RANK_METHODS else ShadowEngineRank
    if name not in ENGINE_RANK_METHODS | SHADOW_RANK_METHODS or \
            getattr(owner, name) is not member:
        raise TypeError(f"expected a member of EngineRank or ShadowEngineRank (one of "
                        f"{sorted(ENGINE_RANK_METHODS | SHADOW_RANK_METHODS)}), got {member!r}")
    return name
