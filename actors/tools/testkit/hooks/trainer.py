"""Fault hooks of a trainer rank (see :mod:`actors.tools.testkit.hooks`)."""


from __future__ import annotations

from typing import Any

import ray

from actors.ready.trainer import TrainerWorker
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


class FaultyTrainerWorker(TrainerFaultHooks, TrainerWorker):
    pass


FaultyTrainerActor = ray.remote(FaultyTrainerWorker)
