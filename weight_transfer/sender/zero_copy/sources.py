"""Trainer memory registered once as write sources, and which source each update uses.

Zero-copy: a piece whose bytes already lie in order in the rank's own memory
(:func:`weight_transfer.layout.zero_copy.zero_copy_span`: a contiguous run of a
shard-direct parameter's block, in the engine's dtype, no transform) is written
straight from there, with no pass through the staging arena. For that:

1. at setup, :meth:`SourceRegistry.register` registers the memory of every
   shard-direct parameter with the transport (``transport.register_source``),
   once per storage: parameters that are views of one buffer (Megatron's param
   buffer, DeepSpeed's flat partitions) share one registration;
2. each update (:meth:`SourcePolicy.begin`) picks its source, ``zero_copy`` or
   ``snapshot``, from the configured mode (``zero_copy | snapshot | auto``), holds
   the trainer's :class:`~weight_transfer.sender.zero_copy.fence.StepFence`, and checks
   every registered parameter's address and size: one that moved or was resized (a
   re-allocation after an optimizer change) is refused, named in the log and the
   report, and staged for this update; its new memory is registered for the next
   one and the old registration dropped, so no write reads freed memory;
3. the fence is released when the update's writes are done (zero-copy) or its
   copies are (snapshot): only then may the next optimizer step change a source.

``auto`` (the default) is zero-copy unless the update would overlap a step: the
caller says so (``overlap=True``: an RL loop or an asynchronous trainer that steps
during updates) or a step is in flight or waiting when the update begins.
A delta update marks no piece zero-copy (a delta is a transform)::

    policy = SourcePolicy(transport=nic, mode="auto", fence=StepFence(), label="rank 0")
    policy.register({name: tensor, ...})                 # once, at setup
    used = await policy.begin(tensors, overlap=False, delta=False)
    ...                                                  # zero-copy pieces of used.params
    policy.release()                                     # after the writes (or the copies)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weight_transfer.sender.flat_shard import FlatShard
from weight_transfer.sender.zero_copy.fence import StepFence

log = logging.getLogger(__name__)

SOURCE_MODES = ("zero_copy", "snapshot", "auto")


def check_source_mode(mode: str) -> str:
    if mode not in SOURCE_MODES:
        raise ValueError(f"source {mode!r} is not one of {', '.join(SOURCE_MODES)}")
    return mode


def local_tensor(x: Any) -> torch.Tensor | None:
    """The memory a rank holds of a parameter: a DTensor's local tensor, a flat
    partition's data, a plain tensor itself (None for anything else)."""
    if isinstance(x, FlatShard):
        return x.data
    if hasattr(x, "to_local") and getattr(x, "device_mesh", None) is not None:
        return x.to_local()
    return x if isinstance(x, torch.Tensor) else None


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a parameter's local tensor lay when it was registered: its bytes and those of
    its storage (the registered region)."""

    addr: int
    nbytes: int
    storage: int
    storage_nbytes: int


def placed(t: torch.Tensor) -> Placed:
    st = t.untyped_storage()
    return Placed(addr=t.data_ptr(), nbytes=t.numel() * t.element_size(),
                  storage=st.data_ptr(), storage_nbytes=st.nbytes())


class SourceRegistry:
    """Registered storages of one rank's shard-direct parameters (see the module docstring)."""

    def __init__(self, transport: Any, *, device_memory: bool, label: str) -> None:
        self.transport, self.device_memory, self.label = transport, device_memory, label
        self.params: dict[str, Placed] = {}
        self._regions: dict[int, tuple[Any, torch.Tensor]] = {}  # storage -> (handle, view)

    def _eligible(self, t: torch.Tensor | None) -> bool:
        return (t is not None and t.numel() > 0 and t.is_contiguous()
                and (not t.is_cuda or self.device_memory))

    def register(self, tensors: Mapping[str, Any]) -> list[str]:
        """Register the memory of ``tensors`` (name -> what the rank holds); returns the
        names registered (those not contiguous, or on a device the NIC cannot read, stay
        staged)."""
        done = []
        for name, x in tensors.items():
            t = local_tensor(x)
            if not self._eligible(t):
                continue
            where = placed(t)
            if where.storage not in self._regions:
                st = t.untyped_storage()
                view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                    st, 0, (st.nbytes(),))
                self._regions[where.storage] = (self.transport.register_source(view), view)
            self.params[name] = where
            done.append(name)
        return done

    def check(self, tensors: Mapping[str, Any]) -> tuple[frozenset[str], tuple[str, ...]]:
        """(the registered parameters still where they were, those that moved): the moved
        ones are registered again for the next update, their old regions dropped."""
        ok, moved = set(), []
        for name, was in self.params.items():
            t = local_tensor(tensors.get(name))
            if t is not None and t.is_contiguous() and placed(t) == was:
                ok.add(name)
                continue
            now = "gone" if t is None else (
                f"{placed(t).nbytes} B at {t.data_ptr():#x}" if t.is_contiguous()
                else "no longer contiguous")
            log.warning("%s: source of parameter %r moved (registered %d B at %#x, now %s): "
                        "staged for this update", self.label, name, was.nbytes, was.addr, now)
            moved.append(name)
        if moved:  # the usual update: nothing moved, nothing to drop or register
            for name in moved:
                del self.params[name]
            self._drop_unused()
            self.register({n: tensors[n] for n in moved if n in tensors})
        return frozenset(ok), tuple(moved)

    def usable(self, name: str, t: torch.Tensor | None) -> bool:
        """Whether ``t`` (what prepare holds of ``name`` now) is its registered memory."""
        was = self.params.get(name)
        return was is not None and t is not None and t.is_contiguous() and placed(t) == was

    def _drop_unused(self) -> None:
        used = {p.storage for p in self.params.values()}
        for storage in [s for s in self._regions if s not in used]:
            handle, _ = self._regions.pop(storage)
            if handle is not None:
                self.transport.deregister_source(handle)

    def close(self) -> None:
        self.params.clear()
        self._drop_unused()


@dataclass(frozen=True, slots=True)
class UpdateSources:
    """What one update reads from: ``mode`` (zero_copy or snapshot), the parameters whose
    zero-copy pieces it writes from their registered memory, those refused (moved)."""

    mode: str
    params: frozenset[str] = frozenset()
    refused: tuple[str, ...] = ()


class SourcePolicy:
    """The per-update choice and its fence (see the module docstring)."""

    def __init__(self, *, transport: Any, mode: str = "auto", fence: StepFence | None = None,
                 device_memory: bool = False, label: str = "trainer",
                 fence_timeout_s: float | None = None) -> None:
        self.mode = check_source_mode(mode)
        self.fence = fence if fence is not None else StepFence(label=label)
        self.registry = SourceRegistry(transport, device_memory=device_memory, label=label)
        self.fence_timeout_s = fence_timeout_s
        self.registered = False
        self._holding = False

    def register(self, tensors: Mapping[str, Any]) -> list[str]:
        """Register the sources once (``snapshot`` never reads them in place: none)."""
        self.registered = True
        return [] if self.mode == "snapshot" else self.registry.register(tensors)

    def choose(self, *, overlap: bool) -> str:
        if self.mode == "snapshot":
            return "snapshot"
        if self.mode == "auto" and (overlap or self.fence.busy):
            return "snapshot"
        return "zero_copy"

    async def begin(self, tensors: Mapping[str, Any], *, overlap: bool = False,
                    delta: bool = False) -> UpdateSources:
        """Pick the update's source, wait for the step in flight, hold the fence. A delta
        update marks no piece zero-copy (its pieces are diffs), but its views of gathered
        tensors follow the mode as a dense update's do."""
        mode = self.choose(overlap=overlap)
        await asyncio.to_thread(self.fence.hold, self.fence_timeout_s)
        self._holding = True
        if not self.registered:
            self.register(tensors)
        ok, moved = self.registry.check(tensors)
        direct = ok if mode == "zero_copy" and not delta else frozenset()
        return UpdateSources(mode=mode, params=direct, refused=moved)

    def release(self) -> None:
        """The sources are no longer read: the next step may change them (idempotent)."""
        if self._holding:
            self._holding = False
            self.fence.release()

    def close(self) -> None:
        self.release()
        self.registry.close()
