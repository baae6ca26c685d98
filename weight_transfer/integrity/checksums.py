"""Checksums of written ranges: what a trainer wrote is what the engine holds.

One-sided WRITEs land in live memory and no receiver checks them. The sender
hashes the exact source bytes of every WRITE the policy selects (xxHash
XXH3-64, :func:`checksum`); after the update each engine rank hashes the same
ranges of its registered memory (:func:`checksum_ranges`) and the controller
compares the two (``actors.controller.checks``)::

    policy = IntegrityPolicy(mode="sample", fraction=0.1)   # or .model_validate("full")
    log = ChecksumLog()
    if policy.selects(task.task_id, turn):                 # sender, per WRITE (turn: run count)
        log.add(task, checksum(src_bytes))
    sums = log.ranges()          # one RangeSums per destination engine rank: compact rows
    actual = checksum_ranges(buffers_by_addr, sums[0].rows[:, ADDR:CHECKSUM])  # engine side

Modes: ``off`` (nothing hashed), ``full`` (every WRITE), ``sample`` (a
``fraction`` of the WRITEs, the default with 0.1: task ``t`` is hashed in turn ``k`` when
``(t + k) % n == 0`` with ``n = ceil(1 / fraction)``). The turn is the count
of runs a sender made since it got its plan (0, 1, 2, ...), not the version
number: versions 0, n, 2n, ... would revisit the same subset, while ``n``
consecutive runs hash every range once whatever the versions are. Every
trainer rank gets every "go" and a new plan starts every rank at turn 0, so
the selection is the same on every process.

A range is one WRITE: (destination replica and rank, region address, offset
in the region, length) and its checksum. :class:`RangeSums` keeps them as one
``uint64`` array per destination rank, five columns (:data:`COLUMNS`), so a
report of 100 000 hashed WRITEs is 4 MB, not 100 000 Python objects.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import xxhash
from pydantic import Field, model_serializer, model_validator

from weight_transfer.config_files import FieldError, StrictModel

Mode = Literal["off", "sample", "full"]
MODES: tuple[str, ...] = get_args(Mode)
COLUMNS = ("task", "addr", "offset", "length", "checksum")
TASK, ADDR, OFFSET, LENGTH, CHECKSUM = range(len(COLUMNS))
ALGORITHM = "xxh3_64"
NO_TASK = 2**64 - 1  # the task column of a row that is not one WRITE (an engine-side chunk)


class IntegrityPolicy(StrictModel):
    """Which WRITEs are hashed: ``mode`` off, sample (``fraction`` of them) or full.

    These defaults are the library's (``TransferConfig.integrity``, a trainer rank's
    ``RankOptions`` and ``RankTransfer`` take ``IntegrityPolicy()``). A mode name stands for
    ``{mode: name}`` (``IntegrityPolicy.model_validate("full")``, ``integrity: full`` in a
    run file); an error names the field (``TransferConfig.integrity.fraction: ...``)."""

    mode: Mode = "sample"
    # strict: True is not a fraction, nor is "0.5"
    fraction: float = Field(default=0.1, gt=0, le=1, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _mode_name(cls, value: Any) -> Any:
        return {"mode": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fraction_for_sample(self) -> IntegrityPolicy:
        if self.mode != "sample" and "fraction" in self.model_fields_set:
            raise FieldError(f"fraction applies to mode 'sample' only (mode is {self.mode!r})")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        """``fraction`` only where it applies: a dump validates again (a run file written
        back, ``RunConfig.with_overrides``)."""
        data = handler(self)
        if isinstance(data, dict) and self.mode != "sample":
            data.pop("fraction", None)
        return data

    # Computed once per policy (the sender asks for every WRITE); not a field: equality,
    # hashing and the YAML dump see mode and fraction only.
    @functools.cached_property
    def period(self) -> int:
        """Updates over which sample mode hashes every range once (1 for full)."""
        return 1 if self.mode == "full" else math.ceil(1 / self.fraction - 1e-9)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def selects(self, task_id: int, turn: int) -> bool:
        """Whether the WRITE of ``task_id`` is hashed in run ``turn`` (0, 1, 2, ...: the
        sender's count of runs since its plan; see the module docstring)."""
        mode = self.mode
        if mode == "sample":
            return (task_id + turn) % self.period == 0
        return mode == "full"

    def describe(self) -> str:
        if self.mode == "sample":
            return f"sample {self.fraction:g} (every range once per {self.period} updates)"
        return self.mode


def _as_buffer(data: Any) -> Any:
    """Something xxhash reads without a copy: host bytes of a tensor, array or buffer."""
    if hasattr(data, "data_ptr") and hasattr(data, "element_size"):  # torch.Tensor
        if data.device.type != "cpu":
            data = data.cpu()  # GPU memory is hashed on the host (one copy)
        if not data.is_contiguous():
            raise ValueError(f"cannot hash a non-contiguous tensor of shape {tuple(data.shape)}")
        n = data.numel() * data.element_size()
        return (ctypes.c_char * n).from_address(data.data_ptr()) if n else b""
    return data


def checksum(data: Any) -> int:
    """XXH3-64 of the bytes of a tensor (any dtype, any device), array or buffer."""
    return xxhash.xxh3_64_intdigest(_as_buffer(data))


class ChecksumLog:
    """Checksums of one run's hashed WRITEs, grouped by destination engine rank."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], list[tuple[int, ...]]] = {}

    def add(self, *, replica: str, rank: int, task: int, addr: int, offset: int, length: int,
            value: int) -> None:
        self._rows.setdefault((replica, rank), []).append((task, addr, offset, length, value))

    def __len__(self) -> int:
        return sum(len(v) for v in self._rows.values())

    def ranges(self) -> tuple[RangeSums, ...]:
        return tuple(RangeSums(replica=rep, rank=rank, rows=np.array(rows, dtype=np.uint64))
                     for (rep, rank), rows in sorted(self._rows.items()))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RangeSums:
    """Hashed WRITEs into one engine rank: ``rows`` is uint64 [n, 5] (:data:`COLUMNS`)."""

    replica: str
    rank: int
    rows: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes of engine memory these ranges cover."""
        return int(self.rows[:, LENGTH].sum()) if len(self.rows) else 0


def merge_ranges(parts: list[RangeSums]) -> dict[tuple[str, int], np.ndarray]:
    """Rows of several senders' :class:`RangeSums`, concatenated per engine rank."""
    out: dict[tuple[str, int], list[np.ndarray]] = {}
    for p in parts:
        out.setdefault((p.replica, p.rank), []).append(p.rows)
    return {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in out.items()}


def checksum_ranges(buffers: Mapping[int, Any], ranges: np.ndarray) -> np.ndarray:
    """Receiver side: XXH3-64 of each (region addr, offset, length) row of ``ranges``.

    ``buffers`` maps the address of each registered region to its memory (a
    uint8 tensor or anything :func:`checksum` hashes, sliceable by bytes). A row
    naming an unknown region or a range outside it is a ValueError naming it.
    """
    ranges = np.asarray(ranges)
    if ranges.ndim != 2 or ranges.shape[1] != 3 or ranges.dtype.kind not in "iu":
        raise ValueError(f"checksum ranges must be an integer array of (addr, offset, length) "
                         f"rows, not {ranges.dtype} of shape {ranges.shape}")
    if ranges.dtype.kind == "i" and len(ranges) and ranges.min() < 0:
        raise ValueError("checksum ranges: negative address, offset or length")
    out = np.empty(len(ranges), dtype=np.uint64)
    for i, (addr, offset, length) in enumerate(ranges.tolist()):
        buf = buffers.get(addr)
        if buf is None:
            raise ValueError(f"checksum range {i}: no registered region at {addr:#x} "
                             f"(regions at {[hex(a) for a in sorted(buffers)][:8]})")
        size = len(buf)
        if offset + length > size:
            raise ValueError(f"checksum range {i}: {length} B at offset {offset} is outside "
                             f"the {size} B region at {addr:#x}")
        out[i] = checksum(buf[offset : offset + length])
    return out
