"""Trainer-rank methods of sparse delta updates (:mod:`weight_transfer.sender.delta.send`), mixed
into :class:`actors.trainer.TrainerMixin`. The controller
(:mod:`actors.controller.delta`) calls, after each (re)plan: ``wt_delta_need()``
(bytes this rank writes per engine rank), then ``wt_delta_connect(slots)`` (its
slot in each engine rank's registered delta arena); before each update
``wt_delta_begin(directive)``; after the engines applied, ``wt_delta_repair``
for ranges they could not apply; ``wt_delta_stats()`` for the bench."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from weight_transfer.delta.policy import DeltaRates
from weight_transfer.sender.delta.send import DeltaDirective, DeltaSender, DeltaSlot
from weight_transfer.sender.delta.write import DeltaStage

log = logging.getLogger(__name__)


class TrainerDeltaMixin:
    """See the module docstring (needs ``self._wt_link`` and ``self._wt_rank``)."""

    _wt_link: Any
    _wt_rank: int

    def _wt_transfer(self) -> Any:
        if self._wt_link is None:
            raise RuntimeError(f"trainer rank {self._wt_rank}: delta call before wt_connect")
        return self._wt_link.transfer

    def wt_delta_need(self) -> dict[str, int]:
        """Bytes this rank's plan writes into each engine rank (by owner name)."""
        need: dict[str, int] = {}
        for g in self._wt_transfer().groups:
            for tasks in g.tasks.values():
                for t in tasks:
                    need[t.region.owner] = need.get(t.region.owner, 0) + t.nbytes
        return need

    def wt_delta_connect(self, slots: dict[str, DeltaSlot] | None,
                         fallback: bool = True) -> int:
        """This rank's slots in the engines' delta arenas (None: back to dense); the
        bytes kept of the last write start empty (the next update is a dense anchor).
        ``fallback``: the time rule (:mod:`weight_transfer.delta.policy`) decides per
        update whether deltas pay; its measured rates are kept across plans."""
        transfer = self._wt_transfer()
        if slots is None:
            transfer.attach_delta(None)
            return 0
        rates = None
        if fallback:
            rates = getattr(self, "_wt_delta_rates", None) or DeltaRates()
            self._wt_delta_rates = rates
        sender = DeltaSender(slots, transport=self._wt_link.nic, rank=self._wt_rank,
                             rates=rates, written=sum(self.wt_delta_need().values()))
        transfer.attach_delta(DeltaStage(sender))
        log.info("trainer rank %d: delta slots in %d engine ranks (%d B mirrored)",
                 self._wt_rank, len(slots), sender.mirror.nbytes)
        return len(slots)

    def wt_delta_begin(self, directive: DeltaDirective) -> bool:
        """The next ``wt_update`` writes deltas where ``directive`` allows (False: no
        slots attached, it writes dense)."""
        stage = self._wt_transfer().delta
        if stage is None:
            return False
        stage.begin(directive)
        return True

    def wt_delta_repair(self, version: int, owners: list[str],
                        ranges: list[tuple[int, int, int]]) -> int:
        """Re-send dense, from the bytes kept of ``version``, this rank's tasks into engine
        ranks ``owners`` and onto ``ranges``; returns the bytes written."""
        transfer = self._wt_transfer()
        stage = transfer.delta
        if stage is None:
            raise RuntimeError(f"trainer rank {self._wt_rank}: repair without delta slots")
        kept = {b.version for b in stage.sender.base.values()}
        if kept and kept != {version}:
            raise RuntimeError(f"trainer rank {self._wt_rank}: asked to repair version "
                               f"{version}, keeps bytes of {sorted(kept)}")
        tasks = transfer.delta_tasks(set(owners), {tuple(r) for r in ranges})
        nic = self._wt_link.nic

        async def run() -> None:
            await asyncio.gather(*(nic.write(src, t.region, t.region_offset)
                                   for src, t in stage.sender.repair(tasks)))

        asyncio.run(run())
        return sum(t.nbytes for t in tasks)

    def wt_delta_stats(self) -> dict | None:
        """The last update's delta counters
        (:class:`~weight_transfer.sender.delta.send.DeltaStats`)."""
        link = self._wt_link
        stage = None if link is None else link.transfer.delta
        return None if stage is None else stage.sender.stats.as_dict()
