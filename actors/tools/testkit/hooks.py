"""Fault injection for tests and ``wt chaos``: test-only subclasses of the ready-made actors.

The production actors carry no fault hooks. A test (or the chaos command)
that injects faults launches these classes instead::

    trainers = launch_trainers(cfg, actor_cls=FaultyTrainerActor)
    replicas = launch_engines(cfg, actor_cls=FaultyInferenceActor)
    ray.get(trainers[1].wt_set_link.remote(False))        # writes of rank 1 fail
    ray.get(replicas[0][0].wt_deregister.remote())        # its regions are revoked
    ray.get(replicas[0][1].wt_flip_byte.remote(name, 3))  # one corrupted byte
    ray.get(replicas[0][1].wt_drop_delta_header.remote(0))  # a delta slot header lost

Trainer hooks go through the transport's optional
:class:`~weight_transfer.transport.base.FaultInjection` interface (simnic only;
other transports refuse with a ``TypeError`` naming the transport). The mixins
also work on a plain :class:`~actors.trainer.TrainerMixin` /
:class:`~actors.inference.InferenceMixin` in a unit test, without Ray.
"""

from __future__ import annotations

from typing import Any

import ray

from actors.ready.inference import InferenceWorker
from actors.ready.trainer import TrainerWorker
from actors.vllm.engine import VllmRank
from weight_transfer.delta.codec import SLOT_HEADER
from weight_transfer.transport.base import fault_injection


class TrainerFaultHooks:
    """NIC faults of one trainer rank (a :class:`~actors.trainer.TrainerMixin`)."""

    def _wt_faults(self) -> Any:
        nic = self.wt_nic
        if nic is None:
            raise RuntimeError(f"trainer rank {self._wt_rank}: no NIC before wt_connect")
        return fault_injection(nic)  # TypeError for a transport without faults

    def wt_set_link(self, up: bool) -> None:
        """Bring this rank's NIC link down (writes fail) or up."""
        self._wt_faults().set_link(up)

    def wt_flap_link(self, down_s: float) -> None:
        """This rank's NIC link goes down at the start of its next write and up again
        ``down_s`` seconds later (a transient fault the retry policy rides out)."""
        self._wt_faults().flap_link(down_s)

    def wt_fail_after_bytes(self, nbytes: int | None) -> None:
        """Deliver ``nbytes`` more bytes, then fail (None: off)."""
        self._wt_faults().fail_after_bytes(nbytes)


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


class FaultyTrainerWorker(TrainerFaultHooks, TrainerWorker):
    pass


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


FaultyTrainerActor = ray.remote(FaultyTrainerWorker)
FaultyInferenceActor = ray.remote(max_concurrency=4)(FaultyInferenceWorker)
