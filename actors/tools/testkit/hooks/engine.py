"""Fault hooks of a reference-engine rank and of a vLLM rank (see
:mod:`actors.tools.testkit.hooks`)."""

from __future__ import annotations

from typing import Any

import ray

from actors.ready.inference import InferenceWorker
from actors.vllm.engine import VllmRank
from weight_transfer.delta.codec import SLOT_HEADER


class EngineFaultHooks:
    """Corrupted and revoked memory of one reference-engine rank (an ``InferenceMixin``)."""

    def wt_flip_byte(self, tensor: str, offset: int = 0) -> None:
        """Invert byte ``offset`` of ``tensor`` in the registered memory, as a corrupted WRITE
        would leave it."""
        self.wt_engine_meta()
        data = self._wt_mem.tensor_bytes(tensor)
        if not 0 <= offset < len(data):
            raise ValueError(f"{self._wt_owner}: no byte {offset} of tensor {tensor!r}")
        data[offset] ^= 0xFF

    def wt_drop_delta_header(self, trainer_rank: int) -> None:
        """Zero the header of ``trainer_rank``'s slot in this rank's delta arena, as if its
        last WRITE never landed (the apply finds the slot unreadable)."""
        arena = self._wt_delta
        if arena is None or trainer_rank not in arena.slots:
            raise ValueError(f"{self._wt_owner}: no delta slot of trainer rank {trainer_rank}")
        off, _ = arena.slots[trainer_rank]
        arena.buffer[off:off + SLOT_HEADER].zero_()

    def wt_deregister(self) -> None:
        """Revoke every registered region (later writes into it fail). The next
        ``wt_engine_meta`` registers the buffers again (new rkeys): a later ``setup()`` of
        the controller re-plans with them."""
        self.wt_engine_meta()
        with self._wt_lock:
            self._wt_mem.deregister()
            self._wt_mem.forget()


class FaultyInferenceWorker(EngineFaultHooks, InferenceWorker):
    pass


def _deregister(owner: Any, rank: int) -> int:
    return owner._in_worker(rank, "deregister")


class _Deregister:
    __slots__ = ("owner", "rank")

    def __init__(self, owner: Any, rank: int) -> None:
        self.owner, self.rank = owner, rank

    def remote(self) -> Any:
        return self.owner.__ray_call__.remote(_deregister, self.rank)


class FaultyVllmRank(VllmRank):
    """A vLLM rank that can revoke its worker's registered memory
    (``launch_vllm_engines(..., rank_cls=FaultyVllmRank)``): ``wt_deregister`` runs in the
    owner actor, which carries no fault hook of its own."""

    __slots__ = ()

    @property
    def wt_deregister(self) -> _Deregister:
        return _Deregister(self.owner, self.rank)


FaultyInferenceActor = ray.remote(max_concurrency=4)(FaultyInferenceWorker)
