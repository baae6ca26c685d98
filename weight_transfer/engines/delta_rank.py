"""Engine-rank methods of sparse delta updates, for any rank that keeps its registered
memory in a :class:`~weight_transfer.engines.registered.RegisteredMemory` (``_wt_mem``)
and its version in a :class:`~weight_transfer.engines.fence.CommandFence`
(``_wt_fence``): the reference engine's actor mixes it in.

``wt_delta_arena(slots)`` (setup, after each plan): register the delta arena once
with the rank's first NIC (the same slots again: the same region, reused);
``wt_delta_apply(version)`` (finish, before the resume): apply every record in
place (:class:`~weight_transfer.engines.delta.DeltaArena`); the result names the
ranges the trainers must re-send dense. In shadow mode (``_wt_shadow`` enabled,
a :class:`~weight_transfer.engines.shadow.rank.ShadowControl`) the records are
applied to the shadow, staged with ``version``, before the flip; their base is the
live version the stage copied into it.
"""

from __future__ import annotations

import logging
from typing import Any

from weight_transfer.engines.delta import DeltaApplied, DeltaArena
from weight_transfer.types import RegionDesc

log = logging.getLogger(__name__)


def held_version(events: list[tuple[str, Any, float]], current: Any) -> int | None:
    """The version this rank's memory held when the update now applied began: the one
    its last resume or version event named, if at most one pause (this update's) came
    after it; None after a hold (a second pause: torn) or before any version."""
    if current is not None:  # no pause (pause_during_update off): still the one held
        return current
    pauses = 0
    for name, version, _ in reversed(events):
        if name == "pause":
            pauses += 1
        elif name in ("resume", "version"):
            return version if pauses <= 1 else None
    return None


class DeltaRankMixin:
    """See the module docstring."""

    _wt_mem: Any
    _wt_fence: Any
    _wt_delta: DeltaArena | None = None
    _wt_shadow: Any = None

    def wt_delta_arena(self, slots: dict[int, tuple[int, int]]) -> RegionDesc:
        """Register (once) a delta arena with these trainer slots; its region."""
        owner = self._wt_mem.owner
        mem = self._wt_mem
        if mem.meta is None or not mem.nics:
            raise RuntimeError(f"{owner}: wt_delta_arena before the engine registered memory")
        arena, nic = self._wt_delta, mem.nics[mem.meta.nic]
        if arena is not None and arena.fits(slots) and arena.registered_on(nic):
            return arena.region
        if arena is not None and arena.registered_on(nic):
            arena.deregister()
        # An arena on another NIC died with it: the memory was registered again since
        # (wt_shadow_setup closes the in-place registration and its NICs).
        arena = self._wt_delta = DeltaArena(slots, owner=owner)
        region = arena.register(nic)
        log.info("%s: delta arena of %d B for %d trainer ranks", owner, arena.nbytes,
                 len(slots))
        return region

    def wt_delta_apply(self, version: int) -> DeltaApplied:
        """Apply the records of ``version`` to the registered memory (in place; in shadow
        mode: the shadow, staged with ``version``)."""
        arena = self._wt_delta
        if arena is None:
            raise RuntimeError(f"{self._wt_mem.owner}: wt_delta_apply without a delta arena")
        shadow = self._wt_shadow
        if shadow is not None and shadow.enabled:  # into the shadow, never live memory
            return shadow.apply_delta(version, lambda held, buffers: arena.apply(
                version=version, held=held, buffers=buffers))
        held = held_version(self._wt_fence.events(), self._wt_fence.version)
        return arena.apply(version=version, held=held, buffers=self._wt_mem.buffers)

    def wt_delta_close(self) -> None:
        if self._wt_delta is not None:
            self._wt_delta.deregister()
            self._wt_delta = None
