"""Plain data shared between processes: metadata, region descriptors, plan pieces.

Everything here is a frozen, slotted dataclass built with keyword arguments, so it
pickles small, hashes, and can be turned into msgpack by ``scheduling.serialize``.
Nothing here imports torch: dtypes travel as their torch attribute names
(``"bfloat16"``, ``"float8_e4m3fn"``), sizes come from :data:`DTYPE_SIZES`.

How the pieces fit together::

    one record:    TensorSpec (name, shape, dtype, nbytes); ParamMeta and
                   EngineTensorMeta extend it, layouts list it
    trainer side:  ParamMeta (global shape, dtype, mesh, placements) x RankInfo
    identities:    EngineRankId (replica, TP rank), NicId (node, index): str() is the
                   name on the wire, so plans and peer keys stay strings
    engine side:   EngineRankMeta (replica, TP/EP shard, NIC) -> EngineTensorMeta
                   (local shape, dtype, region + offset where it lives)
    layout:        Piece = one contiguous destination byte range of one engine
                   tensor and the rectangle of one trainer parameter it comes from
    plan:          WriteTask = a Piece assigned to one source rank, with its
                   destination region and offset, inside one MeshGroup
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype given by its torch attribute name."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}") from None


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """A tensor by name, shape and dtype: the one record the richer metadata extends.

    :class:`ParamMeta`, :class:`EngineTensorMeta`, the engine layout's tensor
    lists and the trainer parameter specs all are (or subclass) this, so the
    byte size is computed in one place.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * dtype_size(self.dtype)


# --------------------------------------------------------------------------- data plane


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionDesc:
    """A registered memory region, as a remote writer needs to know it.

    ``addr`` is the address in the owner's address space (a virtual address for
    simnic and RDMA), ``rkey`` the remote key the owner's NIC checks on every
    write. ``owner`` names the process (e.g. ``"engine0/tp1"``), ``nic`` the NIC
    the region is reachable through, ``transport`` the backend that registered it.
    """

    owner: str
    nic: str
    addr: int
    length: int
    rkey: int
    transport: str = "simnic"
    node: str = ""

    def describe(self) -> str:
        return (
            f"region(owner={self.owner}, nic={self.nic}, addr={self.addr:#x}, "
            f"length={self.length}, rkey={self.rkey:#x})"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    """What one side of a connection tells the other at setup (plain data).

    ``owner``/``nic`` identify the endpoint; ``transport`` the backend;
    ``endpoint`` holds backend-specific fields (simnic: pid and region-table
    handle; rdma: LID, GID, QP number, PSN; mooncake: session id).
    """

    owner: str
    nic: str
    transport: str
    endpoint: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)


# --------------------------------------------------------------------------- trainer side

PLACEMENT_KINDS = ("shard", "replicate", "partial", "flat")



@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """A placement on one mesh dimension: a DTensor's ``shard`` (with ``dim``),
    ``replicate`` or ``partial``, or ``flat``: the parameter flattened and cut into one
    contiguous range of ``ceil(numel / n)`` elements per rank of the dim, the last ones
    shorter or empty (DeepSpeed ZeRO-3's partitions, :mod:`weight_transfer.layout.flat_blocks`)."""

    kind: str
    dim: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENT_KINDS:
            raise ValueError(
                f"placement kind must be one of {', '.join(PLACEMENT_KINDS)}, not {self.kind!r}"
            )
        if (self.kind == "shard") != (self.dim is not None):
            raise ValueError(
                f"placement {self.kind!r} with dim={self.dim!r}: only shard takes a dim"
            )

    def __str__(self) -> str:
        return f"Shard({self.dim})" if self.kind == "shard" else self.kind.capitalize() + "()"


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshDesc:
    """A DeviceMesh as global trainer ranks, row-major over ``shape``."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dim_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if numel(self.shape) != len(self.ranks):
            raise ValueError(f"mesh shape {self.shape} does not hold {len(self.ranks)} ranks")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"mesh ranks repeat: {self.ranks}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamMeta(TensorSpec):
    """One trainer parameter: name as the trainer holds it, global shape and dtype,
    and the mesh and placements it is sharded with."""

    mesh: MeshDesc
    placements: tuple[Placement, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """Where one rank (trainer or engine) runs: its node and the NIC it sends through."""

    rank: int
    node: str
    nic: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerMeta:
    """Gathered trainer metadata: every parameter once, and every rank's placement."""

    params: tuple[ParamMeta, ...]
    ranks: tuple[RankInfo, ...]


# --------------------------------------------------------------------------- identities


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class EngineRankId:
    """One engine rank: local TP rank ``rank`` of replica ``replica``. ``str()`` is the
    name logs, JSON, region owners and NIC peer keys carry (``"engine0/tp1"``)."""

    replica: str
    rank: int

    def __str__(self) -> str:
        return f"{self.replica}/tp{self.rank}"


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class NicId:
    """One NIC: the ``index``-th of node ``node`` (``tnode<i>`` trainer side, ``inode<i>``
    engine side). ``str()`` is the name plans and peer infos carry (``"inode0/nic1"``);
    the cluster config hands these out (``ClusterConfig.engine_nic``), nobody types them."""

    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}/nic{self.index}"

    @classmethod
    def parse(cls, name: str) -> NicId:
        """The NIC a ``str()`` names; ValueError for any other string."""
        node, sep, index = name.rpartition("/nic")
        if not (sep and node and index.isdigit()):
            raise ValueError(f"NIC name {name!r} is not '<node>/nic<index>'")
        return cls(node=node, index=int(index))


# --------------------------------------------------------------------------- engine side


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpec:
    """The shard of the full model one engine rank holds: its TP and EP coordinates."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.ep_rank < self.ep_size):
            raise ValueError(f"bad shard {self}: ranks must lie in [0, size)")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineTensorMeta(TensorSpec):
    """One tensor as an engine rank holds it: local shape/dtype and where it lives."""

    region: RegionDesc
    offset: int = 0


# How an engine rank's registered memory takes an update: "in_place", the memory it
# computes with (written while it is paused); "shadow", a second copy it flips in.
APPLY_MODES = ("in_place", "shadow")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRankMeta:
    """One inference rank: replica, shard, NIC and the tensors it exposes.

    ``served_by_flip``: the tensors are a copy the engine serves only after a flip
    (``wt_flip``; the reference engine's shadow, which it keeps once a shadow-mode set-up
    gave it one): an in-place update (pause, writes, resume) into them would never be
    served, and an in-place controller refuses the rank. vLLM's shadow registration is not
    (its resume reprocesses the registered memory, so in-place updates serve)."""

    replica: str
    rank: int
    node: str
    nic: str
    shard: ShardSpec
    tensors: tuple[EngineTensorMeta, ...]
    served_by_flip: bool = False
    # The layout recorded from the engine itself (vLLM: its own load_weights), source
    # names as in the engine's checkpoint; None: the planner uses our rule tables.
    pieces: tuple[Piece, ...] | None = field(default=None, hash=False, compare=False)

    @property
    def id(self) -> EngineRankId:
        return EngineRankId(replica=self.replica, rank=self.rank)


# --------------------------------------------------------------------------- layout and plan


class Transform(enum.StrEnum):
    """What prepare does to a source rectangle before writing it."""

    COPY = "copy"  # cast to the destination dtype (usually a plain copy)
    FP8_WEIGHT = "fp8_weight"  # 128x128 block-quantize, write the e4m3 values
    FP8_SCALE = "fp8_scale"  # 128x128 block-quantize, write the float32 scale_inv
    # cast, then zero-pad the last dim to ``nbytes / (rows * itemsize)`` columns (a
    # LoRA B of rank r into a max_lora_rank-wide slot: one write, not one per row)
    PAD_COLS = "pad_cols"


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One contiguous destination range of an engine tensor and where it comes from.

    ``src_slice`` is a rectangle of the trainer parameter's global tensor, one
    ``(start, stop)`` per dimension. The destination bytes are
    ``transform(param[src_slice])`` in row-major order, ``nbytes`` long, at
    ``dst_offset`` bytes into the engine tensor ``dst_tensor``.
    """

    dst_tensor: str
    dst_offset: int
    nbytes: int
    dst_dtype: str
    src_param: str
    src_slice: tuple[tuple[int, int], ...]
    transform: Transform = Transform.COPY

    @property
    def src_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.src_slice)


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteTask:
    """A piece assigned to a source trainer rank: one WRITE into one remote region."""

    task_id: int
    mesh_group: int
    src_rank: int
    piece: Piece
    dst_replica: str
    dst_rank: int
    region: RegionDesc
    region_offset: int

    @property
    def nbytes(self) -> int:
        return self.piece.nbytes
