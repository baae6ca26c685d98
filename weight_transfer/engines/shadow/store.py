"""Shadow weights: a second copy of every engine tensor that updates write into, and the flip.

In shadow mode (``TransferConfig.apply="shadow"``) an engine rank holds two
copies of the tensors it computes with: *live* (what the engine reads) and the
*shadow* (what its NICs expose; the plan writes there). The engine serves from
live memory during the whole transfer and the integrity check; at the next step
boundary the rank *flips*: live and shadow swap their bytes (a chunked local
swap through one chunk of scratch memory; a device-to-device swap on GPU), any
cache derived from the weights is reset and the version is set. The pause is the
flip alone.

Why a swap and not a copy: after the flip the shadow holds the version that was
live before it, so a rollback is one more flip (a swap again), even after the
new version served for a while. Memory cost: one more copy of the rank's
weights, plus :data:`FLIP_CHUNK_BYTES` of scratch. Time: a swap reads and
writes both copies, twice the memory traffic of a copy (the scratch chunk stays
in cache).

What the shadow holds is a small state machine, :class:`ShadowState` (pure;
the engine rank runs it under its command fence's lock)::

    s = ShadowState(owner="engine0/tp1")
    s.stage(8)              # a transfer of version 8 writes the shadow (previous dropped)
    s.stage(8, base=7)      # ... a delta transfer: the shadow was first brought to 7 (live)
    s.flip(8, live=7)       # -> 8 now live; the shadow holds 7, complete
    s.rollback(live=8)      # -> 7 live again; the shadow holds 8 (not a rollback target)
    s.discard()             # a failed transfer: the shadow holds nothing complete

Each refused transition is a :class:`ShadowError` (a ValueError) naming the
rank, what was asked and what the shadow holds; nothing changes.
:func:`swap_chunked` is the flip's data movement.

Sparse deltas (``TransferConfig.delta``) in shadow mode: after a flip the shadow holds
the version served *before* (v-1) while the next delta (v -> v+1) is based on v, so
a delta update stages with ``base``: the rank first copies live into the shadow
(:meth:`ShadowCopy.sync`, a plain memory copy while the engine serves; live memory
is only read), then the records of the delta arena are applied to the shadow
(``state.base`` is the version they must name), checked, and flipped as any
shadow update. A dense anchor is the ordinary shadow update (no copy).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

import torch

from weight_transfer.errors import WeightTransferError

Apply = Literal["in_place", "shadow"]

FLIP_CHUNK_BYTES = 8 << 20  # scratch of one swap chunk: fits a server CPU's L3 / a GPU's L2


class ShadowError(WeightTransferError, ValueError):
    """A shadow operation refused (nothing changed): no previous version to roll back to,
    a flip to a version the shadow was not staged with, shadow mode where an engine has
    no shadow."""


class Holds(enum.StrEnum):
    """What the shadow holds."""

    EMPTY = "empty"  # nothing complete: never written, or a transfer that failed
    WRITING = "writing"  # a transfer of ``version`` targets it (complete only when the
    # controller says so, with a flip)
    PREVIOUS = "previous"  # ``version``, complete: what was live before the last flip
    UNDONE = "undone"  # ``version``, complete: rolled back from (not a rollback target)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShadowInfo:
    """One engine rank's shadow, as ``wt_shadow_setup()`` / ``wt_shadow_info()`` report it.

    ``nbytes``: bytes of the shadow (one more copy of every tensor the engine computes
    with) plus ``scratch_bytes`` for the flip; ``live``: the version served;
    ``holds`` / ``version``: what the shadow holds."""

    owner: str
    engine: str
    nbytes: int
    scratch_bytes: int
    live: Any
    holds: str
    version: Any
    device: str = "cpu"
    last_flip_s: float = 0.0  # the engine's pause in its last flip or rollback (the swap)
    last_sync_s: float = 0.0  # the last copy of live into the shadow (a delta's base; the
    # engine serves meanwhile: not a pause)

    @property
    def extra_bytes(self) -> int:
        """Memory shadow mode adds to this rank."""
        return self.nbytes + self.scratch_bytes


class ShadowState:
    """What the shadow of one engine rank holds (see the module docstring). Not locked:
    the caller serializes (the rank's command fence)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.holds = Holds.EMPTY
        self.version: Any = None
        self.base: Any = None  # WRITING only: the version the shadow was copied from live

    def describe(self) -> str:
        if self.holds is Holds.EMPTY:
            return "no complete version (never written, or its last transfer failed)"
        if self.holds is Holds.WRITING:
            return f"version {self.version} being written (a transfer in flight)"
        if self.holds is Holds.PREVIOUS:
            return f"version {self.version}, the previous one"
        return f"version {self.version}, rolled back from"

    def stage(self, version: Any, *, base: Any = None) -> None:
        """A transfer of ``version`` starts writing the shadow: what it held is dropped.
        ``base``: the version whose bytes the shadow now holds whole (a delta update's
        base, copied from live); None: no complete version (a dense transfer)."""
        if version is None:
            raise ShadowError(f"{self.owner}: stage needs a version, not None")
        self.holds, self.version, self.base = Holds.WRITING, version, base

    def delta_base(self, version: Any) -> Any:
        """The base version delta records of ``version`` must name to be applied to the
        shadow (None: no base, every record is refused and re-sent dense); ShadowError
        unless the shadow is being written with ``version``."""
        if self.holds is not Holds.WRITING or self.version != version:
            raise ShadowError(f"{self.owner}: delta records of version {version} refused: the "
                              f"shadow holds {self.describe()}; stage({version}) comes first")
        return self.base

    def check_flip(self, version: Any) -> None:
        """ShadowError unless the shadow was staged with ``version``."""
        if self.holds is not Holds.WRITING or self.version != version:
            raise ShadowError(f"{self.owner}: flip to version {version} refused: the shadow "
                              f"holds {self.describe()}; stage({version}) and its transfer "
                              "come first")

    def flip(self, version: Any, *, live: Any) -> None:
        """The shadow (staged with ``version``) became live; it now holds ``live``, the
        version served before (None: nothing complete to roll back to)."""
        self.check_flip(version)
        self.holds, self.version = (Holds.EMPTY, None) if live is None else \
            (Holds.PREVIOUS, live)
        self.base = None

    def check_rollback(self) -> Any:
        """The version a rollback returns to; ShadowError when there is none."""
        if self.holds is not Holds.PREVIOUS:
            raise ShadowError(f"{self.owner}: no previous version to roll back to: the shadow "
                              f"holds {self.describe()}")
        return self.version

    def rollback(self, *, live: Any) -> Any:
        """Back to the previous version (returned); the shadow holds ``live`` (undone)."""
        back = self.check_rollback()
        self.holds, self.version = (Holds.EMPTY, None) if live is None else \
            (Holds.UNDONE, live)
        return back

    def discard(self) -> bool:
        """A transfer into the shadow failed: it holds nothing complete now. True if it
        was being written (otherwise nothing changes: that transfer never staged it)."""
        if self.holds is not Holds.WRITING:
            return False
        self.holds, self.version, self.base = Holds.EMPTY, None, None
        return True


def scratch_for(buffers: list[torch.Tensor], chunk_bytes: int = FLIP_CHUNK_BYTES
                ) -> torch.Tensor:
    """One chunk of scratch for :func:`swap_chunked`, on the buffers' device."""
    if not buffers:
        raise ValueError("scratch_for needs at least one buffer")
    largest = max(b.numel() for b in buffers)
    return torch.empty(max(1, min(chunk_bytes, largest)), dtype=torch.uint8,
                       device=buffers[0].device)


def swap_chunked(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor) -> int:
    """Swap the bytes of flat uint8 tensors ``a`` and ``b`` (same size and device), one
    ``scratch``-sized chunk at a time; returns the bytes swapped."""
    if a.dtype != torch.uint8 or b.dtype != torch.uint8 or a.dim() != 1 or b.dim() != 1:
        raise ValueError("swap_chunked takes flat uint8 tensors")
    if a.numel() != b.numel():
        raise ValueError(f"swap_chunked: sizes differ ({a.numel()} vs {b.numel()} B)")
    if a.device != b.device or scratch.device != a.device:
        raise ValueError(f"swap_chunked: devices differ ({a.device}, {b.device}, "
                         f"scratch on {scratch.device})")
    step = scratch.numel()
    for start in range(0, a.numel(), step):
        n = min(step, a.numel() - start)
        tmp, x, y = scratch[:n], a[start:start + n], b[start:start + n]
        tmp.copy_(x)
        x.copy_(y)
        y.copy_(tmp)
    return a.numel()


def flat_bytes(buf: Any) -> torch.Tensor:
    """A flat uint8 tensor over registered memory (a tensor or a buffer)."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


class ShadowCopy:
    """The live and shadow buffers of one engine rank, paired in the same layout, the
    state of the shadow, and the flip's swap::

        copy = ShadowCopy("engine0/tp1", "reference", live=adapter.region_buffers(),
                          shadow=adapter.shadow_buffers())
        mem.register(spec, copy.region_buffers(), ...)   # the NICs expose the shadow
        copy.bind(list(mem.buffers))                      # region address -> live bytes
        copy.swap()                                       # the flip's data movement

    ``live`` and ``shadow`` are ``(buffer, entries)`` lists of the same layout (an
    :class:`~weight_transfer.engines.adapter.EngineAdapter`'s ``region_buffers()``).
    """

    def __init__(self, owner: str, engine: str, *, live: list, shadow: list,
                 chunk_bytes: int = FLIP_CHUNK_BYTES) -> None:
        if len(live) != len(shadow):
            raise ShadowError(f"{owner}: {len(shadow)} shadow buffers for {len(live)} live ones")
        for i, ((lb, le), (sb, se)) in enumerate(zip(live, shadow, strict=True)):
            if list(le) != list(se) or flat_bytes(lb).numel() != flat_bytes(sb).numel():
                raise ShadowError(f"{owner}: shadow buffer {i} does not have the layout of "
                                  "its live buffer")
        self.owner, self.engine = owner, engine
        self.live = [flat_bytes(b) for b, _ in live]
        self.shadow = [flat_bytes(b) for b, _ in shadow]
        self._regions = [(b, e) for b, e in shadow]
        self.state = ShadowState(owner)
        self.scratch = scratch_for(self.live, chunk_bytes)
        self.live_by_region: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.shadow)

    @property
    def device(self) -> torch.device:
        return self.live[0].device

    def region_buffers(self) -> list:
        """What the NICs register: the shadow buffers with their entries."""
        return list(self._regions)

    def bind(self, region_addrs: list[int]) -> None:
        """The registered regions' addresses, in buffer order: live bytes per region."""
        if len(region_addrs) != len(self.live):
            raise ShadowError(f"{self.owner}: {len(region_addrs)} regions for "
                              f"{len(self.live)} shadow buffers")
        self.live_by_region = dict(zip(region_addrs, self.live, strict=True))

    def live_addr(self, region_addr: int) -> int:
        """The address of the live bytes behind registered region ``region_addr``."""
        return self.live_by_region[region_addr].data_ptr()

    def sync(self) -> int:
        """Copy every live buffer into its shadow (a delta update's base; the engine may
        serve meanwhile: live memory is only read); returns bytes copied."""
        for live, shadow in zip(self.live, self.shadow, strict=True):
            shadow.copy_(live)
        return self.nbytes

    def swap(self) -> int:
        """Swap every live buffer with its shadow (chunked); returns bytes swapped."""
        return sum(swap_chunked(a, b, self.scratch) for a, b in zip(self.live, self.shadow,
                                                                     strict=True))

    def info(self, live_version: Any, last_flip_s: float = 0.0,
             last_sync_s: float = 0.0) -> ShadowInfo:
        return ShadowInfo(owner=self.owner, engine=self.engine, nbytes=self.nbytes,
                          scratch_bytes=self.scratch.numel(), live=live_version,
                          holds=str(self.state.holds), version=self.state.version,
                          device=str(self.device), last_flip_s=last_flip_s,
                          last_sync_s=last_sync_s)
