"""Lossless compression of ``tcp`` frames: none, lz4 (block) or zstd, chosen per link.

The writer compresses each chunk and sends it raw (codec 0) when that does not
make it smaller; the target decompresses into at most the declared raw length
(no decompression bomb: the bound is checked before). ``lz4`` and ``zstandard``
are imported on first use (``lz4`` and ``zstandard``, dependencies of the project)."""

from __future__ import annotations

import threading
from typing import Any

from weight_transfer.transport.tcp.wire import CODECS


class CodecError(Exception):
    """A payload that does not decompress to its declared length."""


def load_codec(name: str) -> Any:
    """The module behind ``name`` (imported now); ValueError naming the package if missing."""
    try:
        if name == "lz4":
            import lz4.block as mod
        elif name == "zstd":
            import zstandard as mod
        else:
            return None
    except ImportError as exc:
        raise ValueError(f"tcp option compression={name!r} needs its package, a dependency "
                         f"of this project (pip install lz4 zstandard): {exc}") from None
    return mod


class Codec:
    """Compressor and decompressor of one codec (``none``, ``lz4``, ``zstd``)."""

    def __init__(self, name: str, level: int = 1) -> None:
        self.name, self.id, self.level = name, CODECS[name], level
        self._mod = load_codec(name)
        self._local = threading.local()  # zstd contexts are not thread-safe: one per thread

    def _zstd(self) -> tuple[Any, Any]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = (self._mod.ZstdCompressor(level=self.level),
                                     self._mod.ZstdDecompressor())
        return ctx

    def compress(self, data: memoryview) -> tuple[int, Any]:
        """``(codec id, payload)``: the compressed bytes, or ``(0, data)`` if not smaller."""
        if self.id == 0:
            return 0, data
        out = (self._mod.compress(data, store_size=False) if self.name == "lz4"
               else self._zstd()[0].compress(data))
        return (self.id, out) if len(out) < len(data) else (0, data)

    def decompress(self, codec: int, data: memoryview, raw_len: int) -> memoryview:
        """The raw bytes of a payload sent with ``codec``; CodecError if they are not
        exactly ``raw_len`` bytes (a raw payload of another length too)."""
        if codec == 0:
            out: Any = data
        elif codec != self.id:
            raise CodecError(f"codec {codec} where this link uses {self.name!r}")
        else:
            try:
                out = (self._mod.decompress(data, uncompressed_size=raw_len)
                       if self.name == "lz4" else
                       self._zstd()[1].decompress(data, max_output_size=raw_len))
            except Exception as exc:
                raise CodecError(f"{self.name} payload does not decompress: {exc}") from None
        if len(out) != raw_len:
            raise CodecError(f"payload of {len(out)} B where {raw_len} B were declared")
        return memoryview(out)
