"""A served LoRA adapter in a vLLM worker: two slots, written one-sided, flipped by id.

vLLM maps adapter ids to slots in its LoRA model manager (``lora_index_to_id``) and
recomputes its kernels' slot mapping whenever that list changes (``set_adapter_mapping``
compares the slot layout each step). :class:`AdapterSlots` owns two slots for one
served adapter, both pinned in vLLM's caches so vLLM never evicts or reloads them:

* the **served** slot holds the user's id (``LoRARequest(name, lora_int_id, ...)``);
* the **free** slot holds a private id no request uses; the trainers write the next
  version there, one-sided, while requests run on the served slot.

``flip`` (at a step boundary, vLLM's scheduler paused: the only engine code of an
update) swaps the two ids in ``lora_index_to_id``: the user's id now names the new
version's slot, the private id the previous version's, which stays there for
``rollback`` (the same swap back) until the next update writes it. The slot tensors
are registered once, at setup, on the NICs of the full-weight setup when there is one
(the trainers' connections then serve both).

Operations (``init_weight_transfer_engine`` ops of our backend, :data:`LORA_OPS`):
``lora_setup`` (:class:`~.spec.LoraSetup` -> :class:`~.spec.LoraRankMeta`),
``lora_begin`` (-> the free slot; NICs with an update window open it),
``lora_flip``, ``lora_rollback``, ``lora_discard`` (an update ends without a flip),
``lora_close``.

vLLM drops every adapter after a full-weight update (its ``reset_lora_state``): the next
``lora_begin`` takes both slots again (vLLM zeroes them), so after a base update the
adapter is written and flipped once more before requests use it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from weight_transfer.engines.registered import RegisteredMemory
from weight_transfer.engines.vllm.lora.record import (
    adapter_scaling,
    check_adapter,
    record_slot,
    slot_tensors,
)
from weight_transfer.engines.vllm.lora.spec import LoraRankMeta, LoraSetup
from weight_transfer.engines.vllm.memory import storage_bytes
from weight_transfer.types import EngineRankId

log = logging.getLogger(__name__)

PRIVATE_ID = 1 << 30  # + the served id: the free slot's id (no request carries it)
VERSIONS = 2  # slots per served adapter: the version served and the one being written


def lora_manager(model: Any) -> Any:
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise ValueError("this vLLM engine has no LoRA slots: start it with enable_lora=True "
                         f"(and max_loras >= {VERSIONS})")
    return manager


def check_capacity(lora_config: Any) -> None:
    """ValueError naming the numbers unless two versions of an adapter fit."""
    if lora_config.max_loras < VERSIONS or lora_config.max_cpu_loras < VERSIONS:
        raise ValueError(
            f"a served adapter needs {VERSIONS} LoRA slots (the version served and the one "
            f"being written); this engine has max_loras={lora_config.max_loras}, "
            f"max_cpu_loras={lora_config.max_cpu_loras}: start vLLM with "
            f"max_loras >= {VERSIONS} (one more per adapter served beside it)")


class AdapterSlots:
    """One served adapter's two slots in one worker; see the module docstring."""

    def __init__(self, backend: Any, req: LoraSetup) -> None:
        self.manager = lora_manager(backend.model)
        check_capacity(self.manager.lora_config)
        helper = check_adapter(self.manager, req.adapter)  # refused here: nothing touched
        self.req = req
        self.served_id, self.free_id = req.lora_int_id, PRIVATE_ID + req.lora_int_id
        taken = sorted({self.served_id, self.free_id} & set(self.manager.list_adapters()))
        if taken:
            raise ValueError(f"LoRA ids {taken} are already loaded in this engine (an adapter "
                             f"loaded from disk?); serve {req.name!r} under another id")
        self.held = False  # the free slot holds the previous version (a rollback target)
        self.writing = False
        self.mem = RegisteredMemory(f"{backend.owner}/lora:{req.name}")
        try:
            for lora_id in (self.served_id, self.free_id):
                self._pin(lora_id, req.adapter.rank)
            slots = (self.slot(self.served_id), self.slot(self.free_id))
            pieces = tuple(tuple(record_slot(self.manager, s, req.adapter)) for s in slots)
            self.meta = self._register(backend, req, slots, pieces,
                                       adapter_scaling(helper, req.adapter))
        except BaseException:
            self._unpin()
            raise

    def _pin(self, lora_id: int, rank: int) -> None:
        """Register a zero adapter under ``lora_id`` and pin it into a slot (vLLM's own
        calls: the slot is then never evicted, nor reloaded from this CPU copy)."""
        dummy = self.manager.create_dummy_lora(lora_id, rank, {})
        self.manager.add_adapter(dummy)
        self.manager.pin_adapter(lora_id)

    def _unpin(self) -> None:
        """Give both slots back to vLLM (a failed setup, or close)."""
        for lora_id in (self.served_id, self.free_id):
            self.manager.remove_adapter(lora_id)

    def slot(self, lora_id: int) -> int:
        return self.manager.lora_index_to_id.index(lora_id)

    def _register(self, backend, req, slots, pieces, scaling) -> LoraRankMeta:
        used = {p.dst_tensor for ps in pieces for p in ps}
        tensors = {n: t for n, t in slot_tensors(self.manager).items() if n in used}
        dtype = {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()}
        if backend.mem.nics:  # share the full-weight setup's NICs and their connections
            self.mem.nics = backend.mem.nics
        spec = req.transport if req.transport is not None else backend.mem.spec
        if spec is None:
            raise ValueError(f"{backend.owner}: lora_setup needs a transport (no full-weight "
                             "setup to share NICs with)")
        rank = backend.shard.tp_rank
        owner = str(EngineRankId(replica=req.replica, rank=rank))
        engine = self.mem.register(
            spec, [(storage_bytes(t), [(n, tuple(t.shape), dtype[n], 0)])
                   for n, t in sorted(tensors.items())],
            nic_names=req.nics[rank], node=req.node, address=req.address,
            replica=req.replica, rank=rank, shard=backend.shard)
        log.info("%s: adapter %r (id %d) in LoRA slots %s, %d slot tensors registered",
                 owner, req.name, req.lora_int_id, slots, len(tensors))
        return LoraRankMeta(engine=engine, name=req.name, lora_int_id=req.lora_int_id,
                            slots=slots, slot_pieces=pieces, scaling=tuple(sorted(
                                scaling.items())), params=req.adapter.params)

    # ------------------------------------------------------------------ updates

    def begin(self) -> int:
        """The trainers may write the free slot now; returns it. The previous version
        there is no rollback target from now on."""
        self._repin_if_dropped()
        self.held, self.writing = False, True
        self.mem.open_window()
        return self.slot(self.free_id)

    def _repin_if_dropped(self) -> None:
        """vLLM drops every adapter after a full-weight update (``reset_lora_state`` after
        ``finish_weight_update``): take both slots again (vLLM zeroes them); the next
        version written and flipped is served from then on, none is held for a rollback."""
        ids = self.manager.lora_index_to_id
        if self.served_id in ids and self.free_id in ids:
            return
        for lora_id in (self.served_id, self.free_id):
            self.manager.remove_adapter(lora_id)
            self._pin(lora_id, self.req.adapter.rank)
        slots = {self.slot(self.served_id), self.slot(self.free_id)}
        if slots != set(self.meta.slots):
            self._unpin()
            raise RuntimeError(f"adapter {self.req.name!r}: after vLLM dropped its adapters "
                               f"(a full-weight update) the free slots are {sorted(slots)}, "
                               f"not the recorded {list(self.meta.slots)}: lora_close and "
                               "set the adapter up again")
        log.info("adapter %r: slots %s taken again after vLLM dropped its adapters (a "
                 "full-weight update); the served slot is empty until the next flip",
                 self.req.name, sorted(slots))

    def flip(self) -> int:
        """At a step boundary: the served id names the slot just written; the previous
        version stays in the other slot for :meth:`rollback`. Returns the served slot."""
        if not self.writing:
            raise ValueError(f"adapter {self.req.name!r}: flip without lora_begin (no "
                             "version was written)")
        self.mem.close_window()
        self._swap()
        self.held, self.writing = True, False
        return self.slot(self.served_id)

    def discard(self) -> bool:
        """End an update without a flip (a failed transfer): the served version stays; the
        free slot holds no rollback target."""
        if self.writing:
            self.mem.close_window()
        self.writing = self.held = False
        return True

    def rollback(self) -> int:
        """At a step boundary: back to the version before the last flip (one step back)."""
        if self.writing or not self.held:
            raise ValueError(f"adapter {self.req.name!r}: no previous version held for a "
                             "rollback (none flipped yet, already rolled back, or an update "
                             "is being written)")
        self._swap()
        self.held = False
        return self.slot(self.served_id)

    def _swap(self) -> None:
        t0 = time.perf_counter()
        ids = self.manager.lora_index_to_id
        a, b = self.slot(self.served_id), self.slot(self.free_id)
        ids[a], ids[b] = ids[b], ids[a]  # vLLM remaps its kernels at the next step
        log.info("adapter %r: served from slot %d (was %d) in %.1f us", self.req.name, b, a,
                 (time.perf_counter() - t0) * 1e6)

    def close(self) -> None:
        """Revoke the slot tensors' regions (the NICs stay: they may be shared) and give the
        slots back to vLLM."""
        if self.mem.meta is not None:
            self.mem.deregister()
            self.mem.meta = None
        self._unpin()


def _setup(backend: Any, req: LoraSetup) -> LoraRankMeta:
    have = backend.lora.get(req.name)
    if have is not None:
        if have.req.adapter != req.adapter or have.req.lora_int_id != req.lora_int_id:
            raise ValueError(f"adapter {req.name!r} is set up with another adapter or id "
                             "(lora_close first)")
        return have.meta
    backend.lora[req.name] = slots = AdapterSlots(backend, req)
    return slots.meta


def _get(backend: Any, name: str) -> AdapterSlots:
    slots = backend.lora.get(name)
    if slots is None:
        raise ValueError(f"no adapter {name!r} set up in this worker (known: "
                         f"{sorted(backend.lora)})")
    return slots


def _close(backend: Any, name: str) -> bool:
    slots = backend.lora.pop(name, None)
    if slots is not None:
        slots.close()
    return slots is not None


LORA_OPS = {
    "lora_setup": _setup,
    "lora_begin": lambda backend, name: _get(backend, name).begin(),
    "lora_flip": lambda backend, name: _get(backend, name).flip(),
    "lora_rollback": lambda backend, name: _get(backend, name).rollback(),
    "lora_discard": lambda backend, name: _get(backend, name).discard(),
    "lora_close": _close,
}
