"""What a :class:`~actors.controller.WeightTransferController` knows, in one explicit object.

The controller holds one :class:`ControllerState`; its setup
(:mod:`actors.controller.setup`), its updates (:mod:`actors.controller.update`)
and its replica operations (:mod:`actors.controller.replicas`) receive it and
change it, and nothing else keeps state of its own::

    state = ControllerState(trainers=actors, connector=Connector(...))
    state.add_replica_entry("engine0", ranks, metas)   # bookkeeping and NIC owners
    state.versions["engine0"] = 3
    state.newest()                                     # 3
    state.source_of(3, besides="engine1")              # "engine0"
    state.forget_replica("engine0")                    # out of every table

Replica names key every table: ``replicas`` (the actors of its TP ranks, in
rank order), ``engine_metas`` (their metadata), ``versions`` (the version it
holds completely, None while torn or never filled), ``paused`` and ``served``
(the checksums of what it serves, :mod:`weight_transfer.integrity.served`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.connections import Connector
from actors.messages import PlanSummary, TrainerRankMeta
from weight_transfer.integrity.served import ServedBook
from weight_transfer.sync.barrier import BarrierKey
from weight_transfer.types import EngineRankMeta, RankInfo


@dataclass(slots=True, kw_only=True)
class ControllerState:
    """The controller's state (see the module docstring); mutable, never crosses Ray."""

    trainers: list[Any]  # trainer actors, in rank order after setup
    connector: Connector  # NIC owners, hosts and the links connected so far
    replicas: dict[str, list[Any]] = field(default_factory=dict)
    engine_metas: dict[str, list[EngineRankMeta]] = field(default_factory=dict)
    versions: dict[str, int | None] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)
    trainer_metas: list[TrainerRankMeta] = field(default_factory=list)
    rank_infos: tuple[RankInfo, ...] = ()
    summary: PlanSummary | None = None  # None until the first setup() planned
    scheduler: Any = None  # the ScheduleActor, made at the first setup()
    store: Any = None  # the trainers' barrier store of the last setup() (a BarrierStore)
    store_host: str = ""
    barrier_key: BarrierKey | None = None  # this setup's barrier name and secret (Ray only)
    attempted: int | None = None  # the last version an update() started
    in_flight: int | None = None  # the version an update() is moving now (None: none)
    # Shadow mode: per replica, the version its shadow keeps from before its last flip
    # (what rollback() returns to; None: none kept).
    previous: dict[str, int | None] = field(default_factory=dict)
    shadow_bytes: dict[str, int] = field(default_factory=dict)  # engine rank -> extra bytes
    # Per replica, checksums of every byte it serves (actors.controller.served), where kept.
    served: ServedBook = field(default_factory=ServedBook)

    def check_ready(self, what: str) -> None:
        if self.summary is None:
            raise RuntimeError(f"{what} before setup(): call setup() once first")

    def newest(self) -> int | None:
        """The newest version some replica holds completely."""
        held = [v for v in self.versions.values() if v is not None]
        return max(held) if held else None

    def source_of(self, version: int, *, besides: str) -> str | None:
        """A replica other than ``besides`` that holds ``version`` completely."""
        return next((n for n, v in self.versions.items() if v == version and n != besides),
                    None)

    def add_replica_entry(self, name: str, actors: list[Any],
                          metas: list[EngineRankMeta]) -> None:
        if name in self.replicas:
            raise ValueError(f"replica {name} is already part of this controller")
        self.replicas[name], self.engine_metas[name] = actors, metas
        for actor, meta in zip(actors, metas, strict=True):
            self.connector.add_engine(meta, actor)

    def drop_replica_entry(self, name: str, *, keep_links: bool = False) -> None:
        for meta in self.engine_metas.pop(name, []):
            self.connector.drop_engine(meta, keep_links=keep_links)
        self.replicas.pop(name, None)

    def forget_replica(self, name: str) -> None:
        """Out of every table (its NIC owners and links too)."""
        self.drop_replica_entry(name)
        self.served.drop(name)
        self.versions.pop(name, None)
        self.previous.pop(name, None)
        self.paused.discard(name)

    def engine_list(self) -> list[EngineRankMeta]:
        """Every engine rank's metadata, replica by replica."""
        return [m for metas in self.engine_metas.values() for m in metas]
