"""Checks of metadata received from another process, before anything uses it.

Everything that crosses a process boundary (engine metadata with its tensors
and region descriptors, trainer parameter metadata, plan pieces and tasks,
peer information) is checked by the RECEIVING function: a frozen dataclass
restored by pickle or built by a decoder runs no ``__post_init__``, so a
corrupt or hostile sender could hand over negative sizes, unknown dtypes or
ranges outside a region. Each check raises ``ValueError`` naming where
(``where``: "engine0/tp1 tensor 'w'", "plan piece 12" ...), the field and what
was wrong::

    check_engine_meta(meta)                 # the controller, on each engine's metadata
    check_param_meta(p, where="trainer rank 3")
    check_region(desc, where="task 17")
    check_peer_info(info, where="trainer0@nic0", transport="simnic")
    check_tensor_placement(meta)            # tensors inside their regions, no overlap

Limits: 64-bit unsigned for addresses and keys, 2**62 bytes for any size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

from weight_transfer.types import (
    DTYPE_SIZES,
    PLACEMENT_KINDS,
    EngineRankMeta,
    EngineTensorMeta,
    MeshDesc,
    ParamMeta,
    PeerInfo,
    Piece,
    Placement,
    RegionDesc,
    ShardSpec,
    Transform,
)

MAX_U64 = (1 << 64) - 1
MAX_BYTES = 1 << 62  # no tensor, region or write is larger (and sums stay in int64)
MAX_DIMS = 8


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(value: Any, where: str, *, lo: int = 0, hi: int = MAX_BYTES) -> int:
    """``value`` if it is an int (not a bool) in [lo, hi]; else ValueError naming ``where``."""
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{where} must be an integer in [{lo}, {hi}], not {_short(value)}")
    return value


def check_str(value: Any, where: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ValueError(f"{where} must be a {'' if empty else 'non-empty '}string, "
                         f"not {_short(value)}")
    return value


def check_dtype(value: Any, where: str) -> str:
    if value not in DTYPE_SIZES:
        raise ValueError(f"{where}: unknown dtype {_short(value)}; known: {sorted(DTYPE_SIZES)}")
    return value


def check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if not isinstance(shape, tuple) or len(shape) > MAX_DIMS:
        raise ValueError(f"{where}: shape must be a tuple of at most {MAX_DIMS} sizes, "
                         f"not {_short(shape)}")
    for i, d in enumerate(shape):
        check_int(d, f"{where}: shape[{i}]")
    if math.prod(shape) > MAX_BYTES:
        raise ValueError(f"{where}: shape {shape} has more than 2**62 elements")
    return shape


def check_tensor_spec(t: Any, where: str) -> int:
    """Name, shape and dtype of a TensorSpec; returns its byte size."""
    check_str(t.name, f"{where}: name")
    check_shape(t.shape, f"{where} {t.name!r}")
    check_dtype(t.dtype, f"{where} {t.name!r}")
    return check_int(t.nbytes, f"{where} {t.name!r}: bytes (shape x dtype size)")


def check_region(r: Any, where: str) -> RegionDesc:
    """A region descriptor: owner, NIC, transport named; address and length inside 64 bits."""
    if not isinstance(r, RegionDesc):
        raise ValueError(f"{where}: region must be a RegionDesc, not {type(r).__name__}")
    check_str(r.owner, f"{where}: region owner")
    check_str(r.nic, f"{where}: region nic")
    check_str(r.transport, f"{where}: region transport")
    check_str(r.node, f"{where}: region node", empty=True)
    check_int(r.addr, f"{where}: region addr", hi=MAX_U64)
    check_int(r.length, f"{where}: region length", lo=1)
    check_int(r.rkey, f"{where}: region rkey", hi=MAX_U64)
    if r.addr + r.length > MAX_U64 + 1:
        raise ValueError(f"{where}: region {r.addr:#x} + {r.length} B runs past 2**64")
    return r


def check_mesh(m: Any, where: str) -> MeshDesc:
    if not isinstance(m, MeshDesc):
        raise ValueError(f"{where}: mesh must be a MeshDesc, not {type(m).__name__}")
    if not isinstance(m.ranks, tuple) or not m.ranks:
        raise ValueError(f"{where}: mesh ranks must be a non-empty tuple, not {_short(m.ranks)}")
    for i, r in enumerate(m.ranks):
        check_int(r, f"{where}: mesh ranks[{i}]", hi=1 << 24)
    check_shape(m.shape, f"{where}: mesh")
    if math.prod(m.shape) != len(m.ranks) or len(set(m.ranks)) != len(m.ranks):
        raise ValueError(f"{where}: mesh shape {m.shape} does not hold the distinct ranks "
                         f"{_short(m.ranks)}")
    if not isinstance(m.dim_names, tuple) or len(m.dim_names) not in (0, len(m.shape)):
        raise ValueError(f"{where}: mesh dim_names {_short(m.dim_names)} do not match its "
                         f"{len(m.shape)} dimensions")
    for i, d in enumerate(m.dim_names):
        check_str(d, f"{where}: mesh dim_names[{i}]")
    return m


def check_param_meta(p: Any, where: str) -> ParamMeta:
    """One trainer parameter: name, shape, dtype, mesh and placements."""
    if not isinstance(p, ParamMeta):
        raise ValueError(f"{where}: parameter must be a ParamMeta, not {type(p).__name__}")
    check_tensor_spec(p, where)
    here = f"{where} {p.name!r}"
    check_mesh(p.mesh, here)
    if not isinstance(p.placements, tuple) or len(p.placements) not in (0, len(p.mesh.shape)):
        raise ValueError(f"{here}: {len(p.placements) if isinstance(p.placements, tuple) else '?'}"
                         f" placements for a mesh of {len(p.mesh.shape)} dimensions")
    for i, pl in enumerate(p.placements):
        _check_placement(pl, len(p.shape), f"{here}: placements[{i}]")
    return p


def _check_placement(pl: Any, ndim: int, where: str) -> None:
    if not isinstance(pl, Placement) or pl.kind not in PLACEMENT_KINDS:
        raise ValueError(f"{where} must be one of {', '.join(PLACEMENT_KINDS)}, "
                         f"not {_short(pl)}")
    if pl.kind == "shard":
        check_int(pl.dim, f"{where}: shard dim", hi=max(ndim - 1, 0))
    elif pl.dim is not None:
        raise ValueError(f"{where}: {pl.kind} takes no dim (got {pl.dim!r})")


def check_params(params: Iterable[Any], where: str) -> tuple[ParamMeta, ...]:
    """Parameters of one sender: each valid, no name twice."""
    if not isinstance(params, tuple | list):
        raise ValueError(f"{where}: params must be a sequence, not {type(params).__name__}")
    seen: set[str] = set()
    for i, p in enumerate(params):
        check_param_meta(p, f"{where} param {i}")
        if p.name in seen:
            raise ValueError(f"{where}: parameter {p.name!r} is listed twice")
        seen.add(p.name)
    return tuple(params)


def check_shard(s: Any, where: str) -> ShardSpec:
    if not isinstance(s, ShardSpec):
        raise ValueError(f"{where}: shard must be a ShardSpec, not {type(s).__name__}")
    for size, rank in (("tp_size", "tp_rank"), ("ep_size", "ep_rank")):
        n = check_int(getattr(s, size), f"{where}: shard {size}", lo=1, hi=1 << 20)
        check_int(getattr(s, rank), f"{where}: shard {rank}", hi=n - 1)
    return s


def first_overlap(spans_by_region: Mapping[Any, list[tuple[int, int, Any]]]
                  ) -> tuple[tuple[int, int, Any], tuple[int, int, Any]] | None:
    """The first two ``(start, end, label)`` spans of one region that share a byte (empty
    spans share none), or None; sorts each region's list in place."""
    for spans in spans_by_region.values():
        spans.sort()
        for a, b in itertools.pairwise(spans):
            if b[0] < a[1] and a[1] > a[0]:
                return a, b
    return None


def check_tensor_placement(tensors: Iterable[EngineTensorMeta], where: str) -> None:
    """Every tensor inside its region and no two overlapping in one region."""
    by_region: dict[tuple, list[tuple[int, int, str]]] = {}
    for t in tensors:
        end = t.offset + t.nbytes
        if end > t.region.length:
            raise ValueError(f"{where} tensor {t.name!r}: bytes [{t.offset}, {end}) lie outside "
                             f"its {t.region.length} B region ({t.region.describe()})")
        key = (t.region.owner, t.region.nic, t.region.addr)
        by_region.setdefault(key, []).append((t.offset, end, t.name))
    clash = first_overlap(by_region)
    if clash is not None:
        (a0, a1, an), (b0, _, bn) = clash
        raise ValueError(f"{where}: tensors {an!r} [{a0}, {a1}) and {bn!r} "
                         f"[{b0}, ...) overlap in one region")


def check_engine_meta(meta: Any, where: str | None = None) -> EngineRankMeta:
    """One engine rank's metadata, as the controller receives it (see the module docstring)."""
    if not isinstance(meta, EngineRankMeta):
        raise ValueError(f"{where or 'engine metadata'} must be an EngineRankMeta, not "
                         f"{type(meta).__name__}")
    check_str(meta.replica, f"{where or 'engine metadata'}: replica")
    check_int(meta.rank, f"{where or meta.replica}: rank", hi=1 << 20)
    where = where or str(meta.id)
    check_str(meta.node, f"{where}: node", empty=True)
    check_str(meta.nic, f"{where}: nic")
    check_shard(meta.shard, where)
    if not isinstance(meta.served_by_flip, bool):
        raise ValueError(f"{where}: served_by_flip must be a bool, not {meta.served_by_flip!r}")
    if not isinstance(meta.tensors, tuple) or not meta.tensors:
        raise ValueError(f"{where}: tensors must be a non-empty tuple")
    seen: set[str] = set()
    for i, t in enumerate(meta.tensors):
        if not isinstance(t, EngineTensorMeta):
            raise ValueError(f"{where}: tensors[{i}] must be an EngineTensorMeta, not "
                             f"{type(t).__name__}")
        check_tensor_spec(t, f"{where} tensor")
        check_region(t.region, f"{where} tensor {t.name!r}")
        check_int(t.offset, f"{where} tensor {t.name!r}: offset")
        if t.name in seen:
            raise ValueError(f"{where}: tensor {t.name!r} is listed twice")
        seen.add(t.name)
    check_tensor_placement(meta.tensors, where)
    return meta


def check_piece(p: Any, where: str) -> Piece:
    """A plan piece: names, destination range, dtype, source rectangle, transform."""
    if not isinstance(p, Piece):
        raise ValueError(f"{where} must be a Piece, not {type(p).__name__}")
    check_str(p.dst_tensor, f"{where}: dst_tensor")
    check_str(p.src_param, f"{where}: src_param")
    check_int(p.dst_offset, f"{where}: dst_offset")
    check_int(p.nbytes, f"{where}: nbytes", lo=1)
    check_dtype(p.dst_dtype, f"{where}: dst_dtype")
    if not isinstance(p.transform, Transform):
        raise ValueError(f"{where}: unknown transform {_short(p.transform)}")
    sl = p.src_slice
    if not isinstance(sl, tuple) or not 0 < len(sl) <= MAX_DIMS:
        raise ValueError(f"{where}: src_slice must be 1 to {MAX_DIMS} (start, stop) pairs")
    for i, ab in enumerate(sl):
        if not (isinstance(ab, tuple) and len(ab) == 2):
            raise ValueError(f"{where}: src_slice[{i}] must be a (start, stop) pair")
        a = check_int(ab[0], f"{where}: src_slice[{i}] start")
        b = check_int(ab[1], f"{where}: src_slice[{i}] stop")
        if b <= a:
            raise ValueError(f"{where}: src_slice[{i}] ({a}, {b}) is empty")
    return p


def check_peer_info(info: Any, where: str, *, transport: str | None = None) -> PeerInfo:
    """Peer information of the handshake: owner, NIC, transport named; endpoint a mapping
    with string keys; ``transport`` (if given) the one expected."""
    if not isinstance(info, PeerInfo):
        raise ValueError(f"{where}: peer info must be a PeerInfo, not {type(info).__name__}")
    check_str(info.owner, f"{where}: peer owner")
    check_str(info.nic, f"{where}: peer nic")
    check_str(info.transport, f"{where}: peer transport")
    if transport is not None and info.transport != transport:
        raise ValueError(f"{where}: peer {info.owner}@{info.nic} speaks {info.transport!r}, "
                         f"this NIC {transport!r}")
    if not isinstance(info.endpoint, Mapping) or not all(isinstance(k, str)
                                                         for k in info.endpoint):
        raise ValueError(f"{where}: peer endpoint must be a mapping with string keys")
    return info
