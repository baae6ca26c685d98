"""Recorded loader copies -> :class:`~weight_transfer.types.Piece` lists (pure, no vLLM).

vLLM's own ``load_weights``, driven with recording tensors (see
:mod:`weight_transfer.engines.vllm.recording`), says for every checkpoint
tensor which view of it (an op chain: ``narrow``, ``chunk``, indexing ...)
was copied into which strided view of which engine parameter. This module
turns one such copy into pieces::

    rect = rect_of_chain((1024, 256), [("narrow", (0, 0, 512), ())])   # rows 0..512
    pieces = copy_pieces(src="model.layers.0.self_attn.q_proj.weight", rect=rect,
                         view_dims=dims, dst="model.layers.0.self_attn.qkv_proj.weight",
                         dst_dtype="float32", offset=0, shape=(512, 256), stride=(256, 1))

A strided destination view is split into contiguous runs (one piece each).
Only ops that keep the copy a rectangle of the source in row-major order are
accepted; a transpose or a reshape that mixes dimensions is a ValueError naming
the tensor and the op (such a loader needs a transform we do not have).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from weight_transfer.types import Piece, dtype_size

Rect = list[list[int]]


class _Chain:
    """A view of a source tensor: a rectangle of it and which source dim each view dim is."""

    def __init__(self, shape: Sequence[int], name: str) -> None:
        self.rect: Rect = [[0, n] for n in shape]
        self.dims: list[int | None] = list(range(len(shape)))  # None: an inserted size-1 dim
        self.name = name

    def shape(self) -> tuple[int, ...]:
        return tuple(1 if d is None else self.rect[d][1] - self.rect[d][0] for d in self.dims)

    def cut(self, vdim: int, start: int, stop: int) -> None:
        vdim = vdim % len(self.dims)
        d = self.dims[vdim]
        if d is None:
            if (start, stop) != (0, 1):
                raise ValueError(f"{self.name}: cut {start}:{stop} of an inserted dimension")
            return
        a = self.rect[d][0]
        self.rect[d] = [a + start, a + stop]

    def index(self, vdim: int, i: int) -> None:
        vdim = vdim % len(self.dims)
        n = self.shape()[vdim]
        i = i + n if i < 0 else i
        self.cut(vdim, i, i + 1)
        del self.dims[vdim]

    def reshape(self, new: Sequence[int]) -> None:
        """Only inserting or dropping size-1 dimensions keeps the rectangle."""
        new = [int(n) for n in new]
        if -1 in new:
            known = math.prod(n for n in new if n != -1)
            new[new.index(-1)] = math.prod(self.shape()) // max(known, 1)
        kept = [d for d in self.dims if d is None or self.rect[d][1] - self.rect[d][0] != 1]
        sizes = [1 if d is None else self.rect[d][1] - self.rect[d][0] for d in kept]
        real = [(d, n) for d, n in zip(kept, sizes, strict=True) if n != 1]
        if [n for n in new if n != 1] != [n for _, n in real]:
            raise ValueError(f"{self.name}: reshape {self.shape()} -> {tuple(new)} mixes "
                             "dimensions; a loader that does this cannot be replayed as pieces")
        it = iter(real)
        self.dims = [next(it)[0] if n != 1 else None for n in new]


def _getitem(chain: _Chain, idx: Any) -> None:
    items = idx if isinstance(idx, tuple) else (idx,)
    vdim = 0
    for item in items:
        if item is Ellipsis:
            vdim = len(chain.dims) - (len(items) - 1 - items.index(Ellipsis))
            continue
        if isinstance(item, int):
            chain.index(vdim, item)
            continue
        if isinstance(item, slice):
            start, stop, step = item.indices(chain.shape()[vdim])
            if step != 1:
                raise ValueError(f"{chain.name}: strided slice {item} is not a rectangle")
            chain.cut(vdim, start, stop)
            vdim += 1
            continue
        raise ValueError(f"{chain.name}: index {item!r} is not a rectangle")


def _chunk(chain: _Chain, args: tuple, kw: dict, pick: int) -> None:
    chunks = args[0]
    dim = args[1] if len(args) > 1 else kw.get("dim", 0)
    n = chain.shape()[dim]
    size = -(-n // chunks)
    chain.cut(dim, pick * size, min(n, (pick + 1) * size))


def rect_of_chain(shape: Sequence[int], ops: Sequence[tuple], *, name: str = "?"
                  ) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """The source rectangle an op chain selects, and the view's shape.

    ``ops`` are vLLM's ``(op_name, args, kwargs_items)`` triples; ``chunk`` and
    ``unbind`` are followed by ``("__getitem__", (i,), ())`` picking one output.
    """
    chain = _Chain(shape, name)
    ops = list(ops)
    k = 0
    while k < len(ops):
        op, args, kw = ops[k][0], tuple(ops[k][1]), dict(ops[k][2])
        if op in ("chunk", "unbind"):
            if k + 1 >= len(ops) or ops[k + 1][0] != "__getitem__":
                raise ValueError(f"{name}: {op} without picking one output")
            pick = ops[k + 1][1][0]
            if op == "chunk":
                _chunk(chain, args, kw, pick)
            else:
                chain.index(args[0] if args else kw.get("dim", 0), pick)
            k += 2
            continue
        if op == "narrow":
            dim, start, length = args[0], int(args[1]), int(args[2])
            chain.cut(dim, start, start + length)
        elif op == "__getitem__":
            _getitem(chain, args[0])
        elif op in ("view", "reshape"):
            new = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
            chain.reshape(new)
        elif op == "unsqueeze":
            d = args[0] if args[0] >= 0 else args[0] + len(chain.dims) + 1
            chain.dims.insert(d, None)
        elif op == "squeeze":
            chain.reshape([n for n in chain.shape() if n != 1] if not args else
                          [n for i, n in enumerate(chain.shape()) if i != args[0] % len(chain.dims)
                           or n != 1])
        elif op == "contiguous":
            pass
        else:
            raise ValueError(f"{name}: the loader applies {op}{args}, which is not a rectangle "
                             "of the checkpoint tensor in row-major order")
        k += 1
    return tuple((a, b) for a, b in chain.rect), chain.shape()


def _runs(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, base: int = 0):
    """(element offset, [(view dim, index) fixed]) of each contiguous run of a strided view."""
    want, contiguous = 1, True
    for n, s in reversed([(n, s) for n, s in zip(shape, stride, strict=True) if n != 1]):
        if s != want:
            contiguous = False
            break
        want *= n
    if contiguous:
        yield offset, []
        return
    first = next(i for i, n in enumerate(shape) if n != 1)
    for i in range(shape[first]):
        for off, fixed in _runs(shape[first + 1:], stride[first + 1:],
                                offset + i * stride[first], base + first + 1):
            yield off, [(base + first, i), *fixed]


def copy_pieces(*, src: str, rect: tuple, view_shape: tuple[int, ...], dst: str, dst_dtype: str,
                offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> list[Piece]:
    """Pieces of one recorded ``dst_view.copy_(src_view)``: contiguous runs of the view."""
    if [n for n in view_shape if n != 1] != [n for n in shape if n != 1]:
        raise ValueError(f"{dst}: the loader copies a {tuple(view_shape)} view of {src} into "
                         f"a {tuple(shape)} view; only equal shapes are replayable")
    esize = dtype_size(dst_dtype)
    src_dims = [d for d, (a, b) in enumerate(rect) if b - a != 1]
    out = []
    for off, fixed in _runs(tuple(shape), tuple(stride), offset):
        r = [list(x) for x in rect]
        for vdim, i in fixed:  # view dims of extent > 1 are the rectangle's, in order
            d = src_dims[sum(1 for n in shape[:vdim] if n != 1)]
            r[d] = [r[d][0] + i, r[d][0] + i + 1]
        n = math.prod(b - a for a, b in r)
        out.append(Piece(dst_tensor=dst, dst_offset=off * esize, nbytes=n * esize,
                         dst_dtype=dst_dtype, src_param=src,
                         src_slice=tuple((a, b) for a, b in r)))
    return out
