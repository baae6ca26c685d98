"""Sparse deltas of engine-format bytes: diff, encode, and the in-place apply.

A trainer rank keeps the exact bytes it last wrote for a piece (engine format,
after fusion, slicing and FP8 quantization). After a step it diffs the new
bytes against them element by element (the engine dtype's width: 2 bytes for
bf16, 1 for FP8, 4 for float32 scales) and encodes the changed elements in the
smallest of three forms, decided per piece from the count ``k`` of changed
elements among ``n`` (element size ``s``)::

    SPARSE   u32 count per page of 65536 elements, u16 in-page index per change,
             values          4*ceil(n/65536) + 2k + s*k bytes
    BITMAP   one bit per element (packbits), values      ceil(n/8) + s*k bytes
    DENSE    the whole piece                             s*n bytes

Why these: a (u32 offset, u16 length) run list costs 6 bytes per run, and at
RL learning rates changes are scattered (AdamW moves every element a little;
whether its bf16 or FP8 rounding changes is close to independent per element),
so almost every run is one element long; the paged u16 index costs 2 bytes per
change plus 4 bytes per 64 Ki elements.
Against the bitmap it wins below 1/16 changed (fp8 at lr 1e-6 changes 0.4%:
2.4 bytes per change, 12x fewer than dense). The bitmap wins above 1/16
(bf16 at lr 1e-5 changes ~25%: 0.125 + 0.5 bytes per element, a third of
dense). Dense wins above ~90% changed. ``encoded_size`` gives each size from
``(n, k, s)`` alone, so the choice costs nothing beyond the diff.

Every record on the wire is one :data:`RECORD` header (which destination
range, the encoding, the base version and XXH3-64 digests of the base bytes
and of the result) followed by its payload, padded to 8 bytes::

    idx = changed(old, new, itemsize)                   # element indices
    kind, payload = encode(new, idx, itemsize)          # smallest form (or DENSE)
    apply(dst, kind, payload, itemsize, len(idx))       # dst (uint8) becomes new
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

PAGE = 1 << 16  # elements per page of the SPARSE form (in-page indices are u16)
_ELEM = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class Encoding(enum.IntEnum):
    DENSE = 0
    SPARSE = 1
    BITMAP = 2


def digest(data: np.ndarray) -> int:
    """XXH3-64 of a contiguous uint8 array (the chain's base and result digests)."""
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(data)))


def elements(buf: np.ndarray, itemsize: int) -> np.ndarray:
    """``buf`` (uint8) as unsigned integers of ``itemsize`` bytes (bytes if it does not
    divide)."""
    if itemsize not in _ELEM or buf.nbytes % itemsize:
        return buf
    return buf.view(_ELEM[itemsize])


WORDS_ELEMENTWISE = 1 / 32  # of the 8-byte words changed: above it, compare elements


def changed(old: np.ndarray, new: np.ndarray, itemsize: int) -> np.ndarray:
    """Indices (int64, ascending) of the ``itemsize``-byte elements that differ between
    two uint8 arrays of one length.

    Sparse changes are found 8 bytes at a time first (one compare per word, then the
    elements of the changed words only); where more than :data:`WORDS_ELEMENTWISE` of the
    words changed, element by element (gathering a changed word costs about 50 ns: at 3%
    of the words that is already the time of the whole element compare)."""
    if old.nbytes != new.nbytes:
        raise ValueError(f"delta: base has {old.nbytes} B, new bytes {new.nbytes} B")
    eo, en = elements(old, itemsize), elements(new, itemsize)
    per = 8 // eo.itemsize
    if old.nbytes % 8 or per < 2:
        return np.flatnonzero(eo != en)
    words = np.flatnonzero(old.view(np.uint64) != new.view(np.uint64))
    if words.size > WORDS_ELEMENTWISE * (old.nbytes // 8):
        return np.flatnonzero(eo != en)
    rows, cols = np.nonzero(eo.reshape(-1, per)[words] != en.reshape(-1, per)[words])
    return words[rows] * per + cols


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def encoded_size(kind: Encoding, n: int, k: int, itemsize: int) -> int:
    """Payload bytes of ``kind`` for ``k`` changed of ``n`` elements of ``itemsize``."""
    if kind is Encoding.DENSE:
        return n * itemsize
    if kind is Encoding.SPARSE:
        return _pad8(4 * (-(-n // PAGE)) + 2 * k) + k * itemsize
    return _pad8(-(-n // 8)) + k * itemsize


def choose(n: int, k: int, itemsize: int) -> Encoding:
    """The encoding with the fewest bytes (DENSE on ties)."""
    return min(Encoding, key=lambda e: (encoded_size(e, n, k, itemsize), e))


def encode(new: np.ndarray, idx: np.ndarray, itemsize: int,
           kind: Encoding | None = None) -> tuple[Encoding, np.ndarray]:
    """The payload (uint8) that turns the base into ``new`` given the changed element
    indices ``idx`` (from :func:`changed`), in ``kind`` (default: the smallest)."""
    vals = elements(new, itemsize)
    size = vals.itemsize
    n, k = vals.size, idx.size
    kind = choose(n, k, size) if kind is None else Encoding(kind)
    if kind is Encoding.DENSE:
        return kind, new
    out = np.zeros(encoded_size(kind, n, k, size), dtype=np.uint8)
    if kind is Encoding.SPARSE:
        pages = -(-n // PAGE)
        head = _pad8(4 * pages + 2 * k)
        out[: 4 * pages].view(np.uint32)[:] = np.bincount(idx >> 16, minlength=pages)
        out[4 * pages : 4 * pages + 2 * k].view(np.uint16)[:] = idx & 0xFFFF
    else:
        mask = np.zeros(n, dtype=bool)
        mask[idx] = True
        bits = np.packbits(mask, bitorder="little")
        head = _pad8(bits.size)
        out[: bits.size] = bits
    out[head:].view(vals.dtype)[:] = vals[idx]
    return kind, out


def indices(kind: Encoding, payload: np.ndarray, n: int, k: int) -> np.ndarray:
    """The changed element indices a SPARSE or BITMAP payload names (int64)."""
    if kind is Encoding.SPARSE:
        pages = -(-n // PAGE)
        counts = payload[: 4 * pages].view(np.uint32)
        if int(counts.sum()) != k:
            raise ValueError(f"delta: page counts sum to {int(counts.sum())}, not {k}")
        low = payload[4 * pages : 4 * pages + 2 * k].view(np.uint16).astype(np.int64)
        return np.repeat(np.arange(pages, dtype=np.int64) << 16, counts) + low
    bits = np.unpackbits(payload[: -(-n // 8)], count=n, bitorder="little")
    return np.flatnonzero(bits)


def apply(dst: np.ndarray, kind: Encoding, payload: np.ndarray, itemsize: int,
          k: int) -> None:
    """Turn ``dst`` (uint8, the base bytes) into the new bytes, in place: a vectorized
    scatter of the ``k`` changed elements (DENSE: a copy). ValueError on a payload of the
    wrong size (nothing is written then)."""
    dv = elements(dst, itemsize)
    size, n = dv.itemsize, dv.size
    want = encoded_size(Encoding(kind), n, k, size)
    if payload.nbytes != want:
        raise ValueError(f"delta: {Encoding(kind).name} payload of {payload.nbytes} B for "
                         f"{k} of {n} elements of {size} B; expected {want} B")
    if kind == Encoding.DENSE:
        dst[:] = payload
        return
    idx = indices(Encoding(kind), payload, n, k)
    if idx.size != k or (k and int(idx[-1]) >= n):
        raise ValueError(f"delta: payload names {idx.size} elements (of {n}), expected {k}")
    values = payload[payload.nbytes - k * size :].view(dv.dtype)
    dv[idx] = values


# ------------------------------------------------------------------------ wire records

# magic, kind, itemsize, reserved, region addr, region offset, nbytes, payload bytes,
# base version, base digest, new digest, changed elements
RECORD = struct.Struct("<IBBHQQQQqQQQ")
RECORD_MAGIC = 0x44454C54  # "DELT"
# magic, reserved, version, records, bytes used after the header, XXH3-64 of those bytes
SLOT = struct.Struct("<IIqQQQ")
SLOT_MAGIC = 0x534C4F54  # "SLOT"
SLOT_HEADER = _pad8(SLOT.size)


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """One delta record's header: where it lands and what it expects there."""

    kind: Encoding
    itemsize: int
    region_addr: int
    region_offset: int
    nbytes: int  # the destination range (a dense write's size)
    payload: int  # payload bytes after the header
    base_version: int
    base_digest: int
    new_digest: int
    count: int  # changed elements

    @property
    def wire_bytes(self) -> int:
        return _pad8(RECORD.size + self.payload)

    def pack_into(self, buf: np.ndarray, at: int) -> None:
        RECORD.pack_into(buf, at, RECORD_MAGIC, int(self.kind), self.itemsize, 0,
                         self.region_addr, self.region_offset, self.nbytes, self.payload,
                         self.base_version, self.base_digest, self.new_digest, self.count)

    @classmethod
    def unpack_from(cls, buf: np.ndarray, at: int) -> Record:
        (magic, kind, itemsize, _, addr, off, nbytes, payload, base_v, base_d, new_d,
         count) = RECORD.unpack_from(buf, at)
        if magic != RECORD_MAGIC or kind not in tuple(Encoding):
            raise ValueError(f"delta: no record at byte {at} (magic {magic:#x}, kind {kind})")
        return cls(kind=Encoding(kind), itemsize=itemsize, region_addr=addr,
                   region_offset=off, nbytes=nbytes, payload=payload, base_version=base_v,
                   base_digest=base_d, new_digest=new_d, count=count)


def pack_slot_header(buf: np.ndarray, *, version: int, records: int, used: int) -> None:
    """The header at the start of a slot (``buf``: the slot's bytes; records follow it)."""
    body = buf[SLOT_HEADER : SLOT_HEADER + used]
    SLOT.pack_into(buf, 0, SLOT_MAGIC, 0, version, records, used, digest(body))


def read_slot(buf: np.ndarray) -> tuple[int, list[tuple[Record, np.ndarray]]]:
    """(version, [(record, payload view)]) of a slot; ValueError if its header or bytes are
    not a complete slot (a torn or dropped write)."""
    magic, _, version, count, used, body_digest = SLOT.unpack_from(buf, 0)
    if magic != SLOT_MAGIC:
        raise ValueError("delta: slot header missing")
    if SLOT_HEADER + used > buf.nbytes:
        raise ValueError(f"delta: slot says {used} B used, holds {buf.nbytes - SLOT_HEADER}")
    body = buf[SLOT_HEADER : SLOT_HEADER + used]
    if digest(body) != body_digest:
        raise ValueError(f"delta: slot of version {version}: records do not match their digest")
    out, at = [], 0
    for _ in range(count):
        rec = Record.unpack_from(body, at)
        start = at + RECORD.size
        out.append((rec, body[start : start + rec.payload]))
        at += rec.wire_bytes
    if at != used:
        raise ValueError(f"delta: {count} records span {at} B, header says {used}")
    return version, out
