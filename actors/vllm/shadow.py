"""Shadow mode of a vLLM replica, for its owner actor (:class:`actors.vllm.engine.VllmEngineOwner`).

The controller sends every shadow command (``wt_stage``, ``wt_flip``,
``wt_rollback``, ``wt_discard_shadow``) to each TP rank (its owner's methods); the replica
acts once per command: the first rank's call runs it on the whole replica
(vLLM's workers act together), the other ranks' calls of the same epoch find it
done. What the shadow holds is the reference engine's state machine
(:class:`~weight_transfer.engines.shadow.store.ShadowState`), under the replica's
command fence; the memory moves in vLLM's workers
(:mod:`weight_transfer.engines.vllm.shadow`, driven by
:class:`~weight_transfer.engines.vllm.driver.VllmLink`)::

    shadow = VllmShadow("engine0", link, fence)
    shadow.stage(8, epoch)              # vLLM's update session opens while it serves
    shadow.flip(8, epoch, deadline)     # at a step boundary: vLLM's finish (the flip)
    shadow.rollback(epoch, deadline)    # back to the previous version in one flip
    shadow.discard(epoch)               # a failed transfer: live memory untouched

Memory per rank (``ShadowInfo.nbytes``): the copy of the parameters vLLM
computes with directly plus the standby that keeps the previous version (the
loading-format arena of the repacked layers exists in place too).
"""

from __future__ import annotations

import logging
from typing import Any

from weight_transfer.engines.fence import CommandFence
from weight_transfer.engines.shadow.store import ShadowInfo, ShadowState
from weight_transfer.engines.vllm.shadow import CHUNK
from weight_transfer.types import EngineRankId

log = logging.getLogger(__name__)


class VllmShadow:
    """See the module docstring."""

    def __init__(self, replica: str, link: Any, fence: CommandFence) -> None:
        self.replica, self.link, self.fence = replica, link, fence
        self.state = ShadowState(replica)
        self.last_stall_s = 0.0  # the engine's pause of the last flip or rollback
        self.memory: list[dict[str, int]] = []  # per TP rank, set by the owner's setup
        self._done: dict[str, int] = {}  # command -> the epoch the replica carried out

    def info(self, rank: int) -> ShadowInfo:
        mem = self.memory[rank]
        largest = max(mem["arena"], mem["shadow"])
        return ShadowInfo(owner=str(EngineRankId(replica=self.replica, rank=rank)),
                          engine="vllm", nbytes=mem["shadow"] + mem["standby"],
                          scratch_bytes=min(CHUNK, largest), live=self.fence.version,
                          holds=str(self.state.holds), version=self.state.version,
                          last_flip_s=self.last_stall_s)

    def _seen(self, what: str, epoch: int | None) -> bool:
        """Whether another rank's call already carried out this command (same epoch)."""
        return epoch is not None and self._done.get(what) == epoch

    def _did(self, what: str, epoch: int | None) -> None:
        if epoch is not None:
            self._done[what] = epoch

    def stage(self, version: Any, epoch: int | None) -> bool:
        def run() -> None:
            if self._seen("stage", epoch):
                return
            if version is None:
                self.state.stage(version)  # the ShadowError naming it
            if self.link.updating:  # a transfer that never ended (held, or a lost discard)
                self.link.discard()
            self.link.begin()
            self.state.stage(version)
            self._did("stage", epoch)

        return self.fence.fenced("stage", epoch, run)

    def flip(self, version: Any, epoch: int | None, deadline: float | None) -> bool:
        def run(live: Any) -> Any:
            if self._seen("flip", epoch):
                return live
            self.state.check_flip(version)  # refused before the engine pauses
            self.last_stall_s = self.link.flip(version)
            self.state.flip(version, live=live)
            self._did("flip", epoch)
            log.info("%s: flipped to version %s (paused %.4f s)", self.replica, version,
                     self.last_stall_s)
            return version

        return self.fence.swap("flip", epoch, deadline, run)

    def rollback(self, epoch: int | None, deadline: float | None) -> bool:
        def run(live: Any) -> Any:
            if self._seen("rollback", epoch):
                return live
            back = self.state.check_rollback()
            self.last_stall_s = self.link.rollback(version=back)
            self.state.rollback(live=live)
            self._did("rollback", epoch)
            log.info("%s: rolled back to version %s (paused %.4f s)", self.replica, back,
                     self.last_stall_s)
            return back

        return self.fence.swap("rollback", epoch, deadline, run)

    def discard(self, epoch: int | None) -> bool:
        def run() -> None:
            if self._seen("discard", epoch):
                return
            self.state.discard()
            if self.link.updating:
                self.link.discard()
            self._did("discard", epoch)

        return self.fence.fenced("discard", epoch, run)
