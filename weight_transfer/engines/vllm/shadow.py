"""Shadow mode in a vLLM worker: the trainers write a second copy, the engine flips to it.

Two kinds of layers (:mod:`.memory`) and their shadow:

* **reprocessed** layers (on CPU every linear layer and the output head): the
  loading-format arena the trainers write is already a shadow, since vLLM
  computes with repacked kernel tensors; the reprocessing at
  ``finish_weight_update`` is the flip.
* **direct** parameters (norms, the input embedding): :class:`DirectShadow`
  keeps one registered copy of them (an :class:`~.memory.Arena` in their own
  shapes); the flip copies it into the live parameters.

Rollback: :class:`Standby` holds the version before the one being transferred,
saved from the registered memory (arena and direct shadow) when an update
starts, before any write lands. ``rollback`` swaps the registered memory with
the standby (chunked, in place: the registered addresses stay) and flips
again; the version rolled back from is then no rollback target. Memory per
worker in shadow mode: the direct shadow (the direct parameters' bytes once
more) plus the standby (all registered bytes once more), besides the arena
that in-place mode keeps too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from weight_transfer.engines.vllm.memory import Arena
from weight_transfer.types import TensorSpec

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # bytes per step of a swap (one temporary buffer of this size)


class DirectShadow:
    """One registered copy of the parameters the engine computes with directly."""

    def __init__(self, live: dict[str, torch.Tensor], specs: Iterable[TensorSpec],
                 device: torch.device) -> None:
        self.live = live
        self.arena = Arena(specs, device)
        self.views = {name: self.arena.view(name) for name in live}
        with torch.no_grad():
            for name, t in live.items():
                self.views[name].copy_(t)  # the shadow starts at the version served

    @property
    def nbytes(self) -> int:
        return self.arena.buffer.numel()

    def live_bytes(self) -> torch.Tensor:
        """The live parameters' bytes in the shadow's layout (a new buffer: for checks)."""
        out = torch.zeros_like(self.arena.buffer)
        with torch.no_grad():
            for name, t in self.live.items():
                off, n = self.arena.offsets[name], self.arena.specs[name].nbytes
                out[off:off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        return out

    def flip(self) -> None:
        """The live parameters receive the shadow's bytes (their storage stays)."""
        with torch.no_grad():
            for name, t in self.live.items():
                t.copy_(self.views[name])


class Standby:
    """A copy of the registered buffers: the previous version, for a rollback."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.copies = [torch.zeros_like(b) for b in buffers]  # pre-faulted once
        self.held = False  # a complete previous version is held
        self.by_region: dict[int, torch.Tensor] = {}  # registered region addr -> its copy

    def bind(self, region_addrs: list[int]) -> None:
        """The registered regions' addresses, in buffer order."""
        if len(region_addrs) != len(self.copies):
            raise ValueError(f"{len(region_addrs)} regions for {len(self.copies)} buffers")
        self.by_region = dict(zip(region_addrs, self.copies, strict=True))

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.copies)

    def save(self, *, complete: bool) -> None:
        """Copy the registered buffers (the version served) before an update writes them;
        ``complete``: they hold a whole version (not so before the first flip: the arena
        starts empty, the loaded version lives only in vLLM's repacked tensors)."""
        for b, c in zip(self.buffers, self.copies, strict=True):
            c.copy_(b)
        self.held = complete

    def restore(self) -> None:
        """Put the saved bytes back into the registered buffers (a discarded update)."""
        for b, c in zip(self.buffers, self.copies, strict=True):
            b.copy_(c)

    def swap(self) -> None:
        """Exchange the registered buffers' bytes with the standby's, chunk by chunk."""
        tmp = torch.empty(min(CHUNK, max((b.numel() for b in self.buffers), default=1)),
                          dtype=torch.uint8, device=self.buffers[0].device if self.buffers
                          else "cpu")
        for b, c in zip(self.buffers, self.copies, strict=True):
            for off in range(0, b.numel(), tmp.numel()):
                n = min(tmp.numel(), b.numel() - off)
                tmp[:n].copy_(b[off:off + n])
                b[off:off + n].copy_(c[off:off + n])
                c[off:off + n].copy_(tmp[:n])
