"""Control-plane messages between the controller, the schedule actor and the ranks.

Frozen, slotted, keyword-only dataclasses: everything that crosses Ray's
object store besides the version number and the reports. Weights never do.
:func:`check_trainer_metas` checks the trainers' metadata on receipt.
The connection set-up sends the records of
:mod:`weight_transfer.transport.handshake` (``InfoRequest``, ``PeerInfo``,
``Connection``) and the transport's ``TransportSpec``; each trainer gets its plan
with the :class:`RankOptions` of the config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from weight_transfer.integrity.checksums import IntegrityPolicy
from weight_transfer.integrity.receipt import check_int, check_params, check_str
from weight_transfer.model.models import EXPERT_NAMINGS
from weight_transfer.sender.retry import RetryPolicy
from weight_transfer.transport.handshake import HostId
from weight_transfer.transport.options import TransportSpec
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


def check_trainer_meta(meta: object, where: str = "trainer metadata") -> TrainerRankMeta:
    """One trainer rank's metadata as the controller receives it: ValueError naming the
    field for a wrong type, a rank outside [0, world), an unknown expert naming, an invalid
    or repeated parameter (see :mod:`weight_transfer.integrity.receipt`)."""
    if not isinstance(meta, TrainerRankMeta):
        raise ValueError(f"{where} must be a TrainerRankMeta, not {type(meta).__name__}")
    world = check_int(meta.world, f"{where}: world", lo=1, hi=1 << 24)
    where = f"trainer rank {check_int(meta.rank, f'{where}: rank', hi=world - 1)}"
    check_str(meta.node, f"{where}: node", empty=True)
    if meta.expert_naming not in EXPERT_NAMINGS:
        raise ValueError(f"{where}: expert_naming must be one of {list(EXPERT_NAMINGS)}, not "
                         f"{meta.expert_naming!r}")
    check_params(meta.params, where)
    if meta.host is not None and not (isinstance(meta.host, HostId) and
                                      isinstance(meta.host.hostname, str) and
                                      isinstance(meta.host.address, str)):
        raise ValueError(f"{where}: host must be a HostId of two strings, not {meta.host!r}")
    return meta


def check_trainer_metas(metas: Sequence[object]) -> list[TrainerRankMeta]:
    """Every trainer rank's metadata: each valid, one world, ranks 0..world-1 once each."""
    out = [check_trainer_meta(m, f"trainer metadata {i}") for i, m in enumerate(metas)]
    worlds = sorted({m.world for m in out})
    ranks = sorted(m.rank for m in out)
    if len(worlds) != 1 or ranks != list(range(worlds[0])):
        raise ValueError(f"trainer metadata: ranks {ranks} of world sizes {worlds}; expected "
                         f"each rank 0..world-1 exactly once, one world size")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RankOptions:
    """What a trainer rank's pipeline needs of the config, sent with its plan
    (``TransferSettings.rank_options()``; the defaults are the settings' defaults, the
    policies' those of their classes)."""

    barrier_timeout_s: float = 60.0
    watermark_bytes: int = 1 << 30
    transport: TransportSpec | None = None  # None: the NIC wt_endpoints opened, else simnic
    source: str = "auto"  # zero_copy | snapshot | auto (sender.zero_copy.sources)
    metrics: str = "auto"
    integrity: IntegrityPolicy = field(default_factory=IntegrityPolicy)
    retry: RetryPolicy = field(default_factory=RetryPolicy)


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
    # (engine owner, NIC, region address) of every region each rank writes into: what
    # a target that checks writers per region (tcp) is told at the connection set-up
    regions_by_rank: dict[int, tuple[tuple[str, str, int], ...]] = field(
        default_factory=dict, hash=False)
    # "full" or "shard_direct" (scheduling.build.direct); the bytes written from the sources' own
    # shards with no gather; the parameters gathered in shard-direct mode
    gather: str = "full"
    direct_bytes: int = 0
    gathered_params: int = 0
    # trainer rank -> replica -> engine rank -> bytes it writes there (the completion fence,
    # actors.controller.checks)
    dest_bytes_by_rank: dict[int, dict[str, dict[int, int]]] = field(
        default_factory=dict, hash=False)
    # engine rank ("engine0/tp1") -> bytes of its shadow copy (shadow mode; empty in place)
    shadow_bytes: dict[str, int] = field(default_factory=dict, hash=False)
    # bytes whose pieces lie in order in their source rank's own memory, written from it
    # with no staging copy when the update's source is zero_copy (Plan.task_zero_copy)
    zero_copy_bytes: int = 0

    @property
    def staged_bytes(self) -> int:
        """Bytes copied into the staging arena before their WRITE (every byte in an update
        whose source is ``snapshot``; the rest of ``zero_copy_bytes`` otherwise)."""
        return self.bytes_total - self.zero_copy_bytes

    @property
    def gathered_bytes(self) -> int:
        """Bytes written from gathered parameters (``bytes_total - direct_bytes``): every
        byte in ``gather="full"``; in shard-direct mode those of ``gathered_params``."""
        return self.bytes_total - self.direct_bytes

    @property
    def send_imbalance(self) -> float:
        """Max / mean bytes over the sending NICs (1.0: perfectly balanced)."""
        return _imbalance(list(self.send_nic_bytes.values()))

    @property
    def recv_imbalance(self) -> float:
        """Max / mean bytes over the receiving NICs."""
        return _imbalance(list(self.recv_nic_bytes.values()))


def _imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The plan as the trainers receive it: one msgpack blob per rank, and its summary."""

    blobs: tuple[bytes, ...]
    summary: PlanSummary

