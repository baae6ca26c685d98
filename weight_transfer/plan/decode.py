"""Checked decoding of plan blobs: every field read from msgpack is checked before use.

:mod:`scheduling.serialize` decodes what another process sent (a trainer's
plan, a whole plan). A :class:`Reader` turns the raw msgpack values into the
plan's dataclasses and raises ``ValueError`` naming the field (``pieces[12]:
nbytes``, ``groups[0] task 3: region index``) and what was wrong: a value of
the wrong type, a negative or overflowing size, an index outside its table, an
unknown dtype or transform, a piece whose size its slice and dtype do not make.
:func:`check_tasks` then checks one trainer's tasks against their regions::

    data = unpack(blob, "trainer_plan")       # ValueError for anything but that blob
    rd = Reader(data, "trainer_plan")
    pieces = [rd.piece(v, f"pieces[{i}]") for i, v in enumerate(rd.list(data, "pieces"))]
    check_tasks(tasks, where="trainer rank 3")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from weight_transfer.integrity.receipt import (
    check_int,
    check_mesh,
    check_piece,
    check_region,
    first_overlap,
)
from weight_transfer.plan.check import expected_piece_nbytes
from weight_transfer.types import MeshDesc, Piece, RegionDesc, Transform, WriteTask

FORMAT = 1
_TRANSFORMS = {str(t): t for t in Transform}


def unpack(blob: Any, kind: str) -> dict[str, Any]:
    """The top-level map of a ``kind`` blob of :data:`FORMAT`; ValueError for anything else."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise ValueError(f"a {kind} blob must be bytes, not {type(blob).__name__}")
    try:
        data = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except Exception as err:  # msgpack raises several types for corrupt input
        raise ValueError(f"not a {kind} blob: msgpack cannot decode it "
                         f"({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("kind") != kind:
        got = (data.get("kind"), data.get("format")) if isinstance(data, dict) else type(data)
        raise ValueError(f"not a {kind} blob of format {FORMAT} (got {got})")
    return data


class Reader:
    """Checked accessors over one decoded blob (its string table and fields)."""

    def __init__(self, data: dict[str, Any], kind: str) -> None:
        self.kind = kind
        strings = data.get("strings")
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise ValueError(f"{kind} blob: strings must be a list of strings")
        self.s = strings

    def field(self, data: dict[str, Any], name: str) -> Any:
        if name not in data:
            raise ValueError(f"{self.kind} blob lacks the field {name!r}")
        return data[name]

    def list(self, value: Any, where: str, n: int | None = None) -> list:
        if isinstance(value, dict):
            value = self.field(value, where)
        if not isinstance(value, list) or (n is not None and len(value) != n):
            want = "a list" if n is None else f"a list of {n}"
            got = type(value).__name__ if not isinstance(value, list) else f"{len(value)} items"
            raise ValueError(f"{self.kind} blob: {where} must be {want}, not {got}")
        return value

    def str(self, i: Any, where: str) -> str:
        check_int(i, f"{self.kind} blob: {where} (string index)", hi=len(self.s) - 1)
        return self.s[i]

    def index(self, i: Any, table: Sequence[Any], where: str) -> int:
        return check_int(i, f"{self.kind} blob: {where}", hi=len(table) - 1)

    def ints(self, value: Any, where: str, *, lo: int = 0, hi: int = 1 << 62) -> tuple:
        return tuple(check_int(v, f"{self.kind} blob: {where}[{i}]", lo=lo, hi=hi)
                     for i, v in enumerate(self.list(value, where)))

    def piece(self, v: Any, where: str) -> Piece:
        v = self.list(v, where, 7)
        flat = self.ints(v[5], f"{where}: src_slice")
        if len(flat) % 2:
            raise ValueError(f"{self.kind} blob: {where}: src_slice has an odd count of bounds")
        name = self.str(v[6], f"{where}: transform")
        if name not in _TRANSFORMS:
            raise ValueError(f"{self.kind} blob: {where}: unknown transform {name!r}; known: "
                             f"{sorted(_TRANSFORMS)}")
        p = Piece(dst_tensor=self.str(v[0], f"{where}: dst_tensor"), dst_offset=v[1],
                  nbytes=v[2], dst_dtype=self.str(v[3], f"{where}: dst_dtype"),
                  src_param=self.str(v[4], f"{where}: src_param"),
                  src_slice=tuple(zip(flat[::2], flat[1::2], strict=True)),
                  transform=_TRANSFORMS[name])
        check_piece(p, f"{self.kind} blob: {where}")
        want = expected_piece_nbytes(p)
        if want != p.nbytes:
            raise ValueError(f"{self.kind} blob: {where}: nbytes {p.nbytes}, but its slice "
                             f"{p.src_slice} as {p.dst_dtype} ({p.transform}) makes {want}")
        return p

    def region(self, v: Any, where: str) -> RegionDesc:
        v = self.list(v, where, 7)
        r = RegionDesc(owner=self.str(v[0], f"{where}: owner"), nic=self.str(v[1], f"{where}: nic"),
                       addr=v[2], length=v[3], rkey=v[4],
                       transport=self.str(v[5], f"{where}: transport"),
                       node=self.str(v[6], f"{where}: node"))
        return check_region(r, f"{self.kind} blob: {where}")

    def mesh(self, v: Any, where: str) -> MeshDesc | None:
        if v is None:
            return None
        v = self.list(v, where, 3)
        ranks, shape = self.ints(v[0], f"{where}: ranks"), self.ints(v[1], f"{where}: shape")
        names = tuple(self.str(d, f"{where}: dim_names") for d in self.list(v[2], where))
        m = MeshDesc.__new__(MeshDesc)  # checked below, naming the field, not in __post_init__
        for name, value in (("ranks", ranks), ("shape", shape), ("dim_names", names)):
            object.__setattr__(m, name, value)
        return check_mesh(m, f"{self.kind} blob: {where}")


def check_tasks(tasks: Sequence[WriteTask], where: str) -> None:
    """One trainer's tasks: distinct ids, inside their regions, no two writing one byte."""
    ids: set[int] = set()
    spans: dict[tuple, list[tuple[int, int, int]]] = {}
    for t in tasks:
        if t.task_id in ids:
            raise ValueError(f"{where}: task {t.task_id} is listed twice")
        ids.add(t.task_id)
        end = t.region_offset + t.nbytes
        if end > t.region.length:
            raise ValueError(f"{where}: task {t.task_id} writes bytes [{t.region_offset}, {end}) "
                             f"outside its {t.region.length} B {t.region.describe()}")
        key = (t.region.owner, t.region.nic, t.region.addr)
        spans.setdefault(key, []).append((t.region_offset, end, t.task_id))
    clash = first_overlap(spans)
    if clash is not None:
        raise ValueError(f"{where}: tasks {clash[0][2]} and {clash[1][2]} write the same bytes "
                         "of one region")
