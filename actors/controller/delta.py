"""The controller's side of sparse delta updates (``TransferConfig.delta``): the wiring of
delta arenas after each plan, the directive before each update, the apply at finish and
the dense repair of what an engine could not apply, and when an update is a dense anchor.

::

    chain = DeltaChain(state, calls, config)
    chain.before(version)        # (re)wire after a new plan; anchor or delta; tell trainers
    ...                          # the trainers' writes (records into the engines' arenas)
    chain.after(version, names)  # every rank of ``names`` applies in place; stale ranges
                                 # and unreadable slots are re-sent dense by the trainers
    chain.failed()               # a fault: the next update is a dense anchor
    chain.last                   # the last update's DeltaRound (applied, repaired, seconds)

An update is a dense anchor (every piece written whole; the trainers refresh the
bytes they keep) when it is the first after a (re)plan (setup, add_replica,
remove_replica), after a fault or a re-sync (:meth:`DeltaChain.request_anchor`),
and after ``delta_anchor_every`` delta updates in a row. Between anchors each
replica gets records only while the controller holds it at the base version
(``state.versions``); the engine checks the base digest of every range again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.config import TransferConfig
from actors.controller.calls import ControlCalls
from actors.controller.state import ControllerState
from weight_transfer.engines.delta import DeltaApplied, arena_layout
from weight_transfer.sender.delta.send import DeltaDirective, DeltaSlot
from weight_transfer.types import EngineRankId

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaRound:
    """What the delta side of one update did."""

    version: int
    anchor: bool
    applied: tuple[DeltaApplied, ...] = ()
    repaired_bytes: int = 0  # re-sent dense after the apply (stale or unreadable)
    apply_seconds: float = 0.0  # the apply fan-out's wall time (every rank in parallel)
    repair_seconds: float = 0.0
    reasons: tuple[str, ...] = field(default=())

    @property
    def apply_cpu_seconds(self) -> float:
        return sum(a.seconds for a in self.applied)

    @property
    def records_applied(self) -> int:
        return sum(a.records for a in self.applied)


class DeltaChain:
    """See the module docstring."""

    def __init__(self, state: ControllerState, calls: ControlCalls,
                 config: TransferConfig) -> None:
        self.state, self.calls, self.config = state, calls, config
        self.every = config.delta_anchor_every
        self.fraction = config.delta_arena_fraction
        self.plan_id: int | None = None
        self.since_anchor = 0
        self.force = True
        self.anchor = True
        self.last: DeltaRound | None = None
        self.fallback = config.delta_fallback == "time"
        self.apply_s_per_byte: float | None = None  # measured, handed to the time rule
        self.fixed_s: float | None = None  # ... and the fixed part of a delta update
        self._most_records = 0

    def request_anchor(self) -> None:
        """The next update writes every piece dense (after a re-sync, a fault ...)."""
        self.force = True

    failed = request_anchor

    def _get(self, refs: Any) -> Any:
        return ray.get(refs, timeout=self.config.setup_timeout_s)

    def wire(self) -> None:
        """Slots in every engine rank's delta arena for every trainer rank that writes
        there, registered by the engines and handed to the trainers."""
        st = self.state
        needs = self._get([t.wt_delta_need.remote() for t in st.trainers])
        by_owner: dict[str, dict[int, int]] = {}
        for rank, need in enumerate(needs):
            for owner, nbytes in need.items():
                by_owner.setdefault(owner, {})[rank] = nbytes
        slots: list[dict[str, DeltaSlot]] = [{} for _ in st.trainers]
        owners, refs, layouts = [], [], []
        for name, actors in st.replicas.items():
            for r, actor in enumerate(actors):
                owner = str(EngineRankId(replica=name, rank=r))
                layout, _ = arena_layout(by_owner.get(owner, {}), self.fraction)
                owners.append(owner)
                layouts.append(layout)
                refs.append(actor.wt_delta_arena.remote(layout))
        for owner, layout, region in zip(owners, layouts, self._get(refs), strict=True):
            for rank, (off, size) in layout.items():
                slots[rank][owner] = DeltaSlot(region=region, offset=off, size=size)
        self._get([t.wt_delta_connect.remote(s, self.fallback)
                   for t, s in zip(st.trainers, slots, strict=True)])
        self.plan_id = st.summary.plan_id
        self.force = True
        log.info("delta arenas wired for plan %d: %d engine ranks", self.plan_id, len(owners))

    def before(self, version: int) -> DeltaDirective:
        """Wire after a new plan; decide anchor or delta; tell every trainer."""
        if self.plan_id != self.state.summary.plan_id:
            self.wire()
        self.anchor = self.force or self.since_anchor >= self.every
        directive = DeltaDirective(version=version, anchor=self.anchor,
                                   held=dict(self.state.versions),
                                   apply_s_per_byte=self.apply_s_per_byte,
                                   fixed_s=self.fixed_s)
        self._get([t.wt_delta_begin.remote(directive) for t in self.state.trainers])
        return directive

    def _apply_rate(self, applied: tuple[DeltaApplied, ...]) -> None:
        """The engines' apply seconds per destination byte (summed over engine ranks: as if
        they applied one after another), set by a round with most records, else blended."""
        covered, records = sum(a.bytes for a in applied), sum(a.records for a in applied)
        if not covered:
            return
        rate = sum(a.seconds for a in applied) / covered
        self._most_records = max(self._most_records, records)
        old = self.apply_s_per_byte
        whole = old is None or records * 2 >= self._most_records
        self.apply_s_per_byte = rate if whole else (old + rate) / 2

    def measured(self, seconds: float, transfer_seconds: float) -> None:
        """After a successful update of ``seconds`` (the slowest trainer rank's run:
        ``transfer_seconds``): for a delta update with most records and no repair, the
        controller's fixed part (the update less the run and the apply fan-out) blended
        into :attr:`fixed_s`, the time rule's ``F_update``."""
        last = self.last
        if (last is None or last.anchor or last.repaired_bytes
                or last.records_applied * 2 < self._most_records):
            return
        got = max(0.0, seconds - transfer_seconds - last.apply_seconds)
        self.fixed_s = got if self.fixed_s is None else (self.fixed_s + got) / 2

    def after(self, version: int, names: list[str]) -> DeltaRound:
        """Every rank of replicas ``names`` applies ``version`` in place; the trainers
        re-send dense what could not be applied. The round is also :attr:`last`."""
        st = self.state
        t0 = time.perf_counter()
        refs = [a.wt_delta_apply.remote(version) for n in names for a in st.replicas[n]]
        applied = tuple(self._get(refs))
        t1 = time.perf_counter()
        self._apply_rate(applied)
        bad = [[a.owner for a in applied if rank in a.bad_slots]
               for rank in range(len(st.trainers))]
        ranges = sorted({r for a in applied for r in a.stale})
        repaired = 0
        if ranges or any(bad):
            log.warning("delta version %d: re-sending dense %d ranges, and every range of "
                        "trainer ranks' unreadable slots %s (%s)", version, len(ranges), bad,
                        [r for a in applied for r in a.reasons][:3])
            repaired = sum(self._get([t.wt_delta_repair.remote(version, owners, ranges)
                                      for t, owners in zip(st.trainers, bad, strict=True)]))
        self.since_anchor = 0 if self.anchor else self.since_anchor + 1
        self.force = False
        self.last = DeltaRound(version=version, anchor=self.anchor, applied=applied,
                               repaired_bytes=repaired, apply_seconds=t1 - t0,
                               repair_seconds=time.perf_counter() - t1,
                               reasons=tuple(r for a in applied for r in a.reasons)[:8])
        return self.last
