"""Control-plane messages between the controller, the schedule actor and the ranks.

Frozen, slotted, keyword-only dataclasses: everything that crosses Ray's
object store besides the version number and the reports. Weights never do.
The connection set-up sends the records of
:mod:`weight_transfer.transport.handshake` (``InfoRequest``, ``PeerInfo``,
``Connection``) and the transport's ``TransportSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weight_transfer.transport.handshake import HostId
from weight_transfer.types import ParamMeta, RankInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerRankMeta:
    """What one trainer rank holds: its live parameters (FSDP2 DTensor metadata)."""

    rank: int
    world: int
    node: str  # Ray node id the rank runs on
    expert_naming: str
    params: tuple[ParamMeta, ...]
    host: HostId | None = None  # hostname and address (several Ray nodes may share a host)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSummary:
    """Numbers about a computed plan (what it moves where), without the tasks."""

    plan_id: int
    bytes_total: int
    num_tasks: int
    num_groups: int
    replicas: tuple[str, ...]
    trainer_ranks: tuple[RankInfo, ...]
    bytes_by_rank: dict[int, int] = field(hash=False)
    replicas_by_rank: dict[int, tuple[str, ...]] = field(hash=False)
    bytes_by_replica: dict[str, int] = field(hash=False)
    send_nic_bytes: dict[str, int] = field(hash=False)
    recv_nic_bytes: dict[str, int] = field(hash=False)
    plan_seconds: float = 0.0
    expert_naming: str = "per_expert"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The plan as the trainers receive it: one msgpack blob per rank, and its summary."""

    blobs: tuple[bytes, ...]
    summary: PlanSummary

