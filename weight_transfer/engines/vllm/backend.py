"""``OneSidedBackend``: vLLM's weight-transfer engine interface, backed by our NICs.

Created by vLLM in each worker (``WeightTransferConfig(backend="wt_onesided")``).
The driver (:class:`weight_transfer.engines.vllm.driver.VllmLink`) sends it
operations through ``init_weight_transfer_engine`` (see :mod:`.mailbox`):

* ``setup``: record where ``load_weights`` puts every checkpoint slice
  (:mod:`.recording`), register the memory the trainers write (:mod:`.memory`:
  parameters the engine computes with directly, plus one loading-format arena
  for layers vLLM repacks) with NICs of the requested transport, and reply
  with this rank's :class:`~weight_transfer.types.EngineRankMeta`, its
  ``pieces`` the recorded layout;
* ``endpoints`` / ``connect``: the two rounds of connection set-up
  (:mod:`weight_transfer.transport.handshake`), run here because a NIC's
  region table belongs to the process that registered the memory;
* ``copy_to``: write this rank's registered memory into another replica's;
* ``checksum``: hashes of written ranges (the controller's integrity check);
* ``stats``, ``deregister`` (fault injection, :mod:`actors.tools.testkit.hooks`), ``close``;
* shadow mode (``SetupRequest.apply="shadow"``, :mod:`.shadow`): ``discard`` (the update
  in progress ends without touching live memory), ``rollback`` (back to the version
  before the last flip), ``memory`` (the bytes each copy costs), ``live_checksum`` (the
  integrity hashes of the version served).
* ``lora_setup`` / ``lora_begin`` / ``lora_flip`` / ``lora_rollback`` / ``lora_close``: a
  served LoRA adapter written one-sided into vLLM's adapter slots (:mod:`.lora`);
* ``delta_arena`` / ``delta_apply``: sparse delta updates
  (:class:`~weight_transfer.engines.delta.DeltaArena`): the arena registered once, and the
  in-place apply of a version's records, run in the finish phase just before
  ``finish_weight_update`` reprocesses the repacked layers (a range the apply refuses is
  re-sent dense by the trainers in between, so the reprocess sees every byte).

The NICs, regions, connection set-up, copies, checksums and statistics are the
engine-neutral :class:`~weight_transfer.engines.registered.RegisteredMemory`,
as for every engine rank.

An update: ``start_weight_update`` (the driver has stopped scheduling steps;
NICs that enforce an update window, tcp, open it), the trainers' one-sided writes
(this code does not run), ``finish_weight_update``: the window closes, then the
repacked layers are reprocessed with vLLM's own functions. ``update_weights``
carries no data and is a no-op. In shadow mode the driver runs that session while
the engine serves (the trainers write the shadow: the arena and the direct
parameters' copy) and pauses only for ``finish_weight_update``, the flip.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weight_transfer.engines.delta import DeltaApplied, DeltaArena
from weight_transfer.engines.registered import RegisteredMemory
from weight_transfer.engines.vllm import inbox
from weight_transfer.engines.vllm.lora.slots import LORA_OPS
from weight_transfer.engines.vllm.memory import Arena, reprocess, reprocessed, storage_bytes
from weight_transfer.engines.vllm.recording import exposed_shapes, record_load
from weight_transfer.engines.vllm.shadow import DirectShadow, Standby
from weight_transfer.layout.recording import checkpoint as ckpt
from weight_transfer.types import APPLY_MODES, EngineRankId, EngineRankMeta, ShardSpec

log = logging.getLogger(__name__)


@dataclass
class OneSidedInitInfo(WeightTransferInitInfo):
    op: str = "setup"
    mailbox: str = ""
    seq: int = 0
    rank: int = -1  # the TP rank that acts; -1: every rank
    # A controller on another host (.channel): the request signed in the info, the reply sent
    # to ``reply``; empty: the mailbox directory.
    session: str = ""
    reply: str = ""
    payload: str = ""
    mac: str = ""


@dataclass
class OneSidedUpdateInfo(WeightTransferUpdateInfo):
    pass


def _shard() -> ShardSpec:
    from vllm.distributed import parallel_state as ps

    return ShardSpec(tp_rank=ps.get_tensor_model_parallel_rank(),
                     tp_size=ps.get_tensor_model_parallel_world_size())


class OneSidedBackend(WeightTransferEngine[OneSidedInitInfo, OneSidedUpdateInfo]):
    init_info_cls = OneSidedInitInfo
    update_info_cls = OneSidedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.shard = _shard()
        self.mem = RegisteredMemory(f"?/tp{self.shard.tp_rank}")
        self._repack: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
        self._arena: Arena | None = None
        self.views: dict[str, torch.Tensor] = {}  # registered tensor -> its memory (checks)
        self.finished = 0
        self.apply = "in_place"  # or "shadow" (SetupRequest.apply)
        self._shadow: DirectShadow | None = None
        self._standby: Standby | None = None
        self._discard = False  # the update in progress ends without a flip
        self._complete = False  # the registered memory holds a whole version (flipped)
        self._staging = False  # vLLM's update session is open: the trainers may write
        self._delta: DeltaArena | None = None  # sparse deltas: registered once (delta_arena)
        self.lora: dict[str, Any] = {}  # served adapter name -> its slots (.lora.slots)

    @property
    def meta(self) -> EngineRankMeta | None:
        return self.mem.meta

    @property
    def owner(self) -> str:
        return self.mem.owner

    # ------------------------------------------------------------------ operations

    def init_transfer_engine(self, init_info: OneSidedInitInfo) -> None:
        if init_info.rank not in (-1, self.shard.tp_rank):
            return
        # Verified first; a request that cannot be verified gets nothing, anywhere (.inbox).
        inbox.serve(init_info, rank=self.shard.tp_rank, owner=self.owner,
                    run=lambda request: _run_op(self, init_info.op, request))

    def _setup(self, req) -> EngineRankMeta:
        apply = getattr(req, "apply", "in_place")
        if apply not in APPLY_MODES:
            raise ValueError(f"SetupRequest.apply: {apply!r} is not one of {APPLY_MODES}")
        if self.meta is not None:
            self.mem.check_spec(req.transport)
            if apply != self.apply:
                raise ValueError(f"{self.owner}: registered for apply={self.apply!r}, asked "
                                 f"for apply={apply!r} (close first)")
            return self.meta
        self.apply = apply
        t0 = time.perf_counter()
        checkpoint = req.checkpoint or ckpt.checkpoint_specs(self.model_config.model)
        layout = record_load(self.model, checkpoint=checkpoint, device=self.device)
        self.mem.owner = str(EngineRankId(replica=req.replica, rank=self.shard.tp_rank))
        buffers = [(buf, [(s.name, s.shape, s.dtype, off) for s, off in entries])
                   for buf, entries in self._buffers(layout, exposed_shapes(layout))]
        meta = self.mem.register(req.transport, buffers, nic_names=req.nics[self.shard.tp_rank],
                                 node=req.node, address=req.address, replica=req.replica,
                                 rank=self.shard.tp_rank, shard=self.shard,
                                 pieces=layout.pieces)
        if apply == "shadow":
            self._standby = Standby([buf for buf, _ in buffers])
            self._standby.bind(list(self.mem.buffers))
        log.info("%s: %d tensors (%d in the repack arena) registered in %.2f s, apply=%s, "
                 "memory %s", self.owner, len(meta.tensors), len(self._arena or ()),
                 time.perf_counter() - t0, apply, self._memory())
        return meta

    def _buffers(self, layout, exposed):
        """[(uint8 buffer, [(TensorSpec, byte offset)])]: one per direct parameter, then
        the arena of the repacked layers' loading-format tensors."""
        from vllm.platforms import current_platform

        modules = dict(self.model.named_modules())
        head = getattr(self.model, "lm_head", None)
        on_cpu = current_platform.is_cpu()
        direct, packed = [], []
        for name in exposed:
            module = modules[layout.modules[name]]
            (packed if reprocessed(module, on_cpu=on_cpu, lm_head=head) else direct).append(name)
        out = []
        params = dict(self.model.named_parameters())
        if self.apply == "shadow" and direct:  # registered: a copy, flipped into the params
            self._shadow = DirectShadow({n: params[n].data for n in direct},
                                        [layout.params[n] for n in direct], self.device)
            self.views.update(self._shadow.views)
            out.append((self._shadow.arena.buffer,
                        [(exposed[n], self._shadow.arena.offsets[n]) for n in direct]))
            direct = []
        for name in direct:
            self.views[name] = params[name].data
            out.append((storage_bytes(params[name].data), [(exposed[name], 0)]))
        if packed:
            self._arena = Arena([layout.params[n] for n in packed], self.device)
            for name in packed:
                pname = name.rsplit(".", 1)[-1]
                module = modules[layout.modules[name]]
                self._repack.setdefault(module, {})[pname] = self._arena.view(name)
                self.views[name] = self._arena.view(name)
            out.append((self._arena.buffer,
                        [(exposed[n], self._arena.offsets[n]) for n in packed]))
        return out

    def _endpoints(self, requests):
        return self.mem.endpoints(requests)

    def _connect(self, conns):
        return self.mem.connect(conns)

    def _copy_to(self, dst: EngineRankMeta) -> int:
        """The version served into ``dst``: in shadow mode while a transfer writes the
        registered memory, from the standby (which holds it then)."""
        if self._staging and self._standby is not None:
            return self.mem.copy_to(dst, lambda addr: self._standby.by_region[addr].data_ptr())
        return self.mem.copy_to(dst)

    def _live_checksum(self, ranges) -> Any:
        """:meth:`_checksum` of the version served, at the registered offsets: the direct
        parameters themselves; the repacked layers in loading format (vLLM computes with
        their repacked form): the registered arena, or the standby while a transfer
        writes the arena."""
        if self._standby is None:
            return self.mem.checksum(ranges)
        buffers = dict(self._standby.by_region if self._staging else self.mem.buffers)
        if self._shadow is not None:
            addr = next(a for a, b in self.mem.buffers.items()
                        if b.data_ptr() == self._shadow.arena.buffer.data_ptr())
            buffers[addr] = self._shadow.live_bytes()
        return self.mem.checksum(ranges, buffers=buffers)

    def _stats(self, _req=None) -> dict[str, int]:
        return {**self.mem.stats(), "finished": self.finished,
                "refused_requests": inbox.refused_requests()}

    def _checksum(self, ranges) -> Any:
        """XXH3-64 of (region address, offset, length) rows of the registered memory (the
        controller's integrity check, while the engine is paused)."""
        return self.mem.checksum(ranges)

    def _memory(self, _req=None) -> dict[str, int]:
        """Bytes of each copy this worker keeps: ``arena`` (loading format of the repacked
        layers, both modes), ``shadow`` (the direct parameters' copy) and ``standby`` (the
        previous version, for a rollback), both in shadow mode only."""
        return {"arena": 0 if self._arena is None else self._arena.buffer.numel(),
                "shadow": 0 if self._shadow is None else self._shadow.nbytes,
                "standby": 0 if self._standby is None else self._standby.nbytes}

    def _discard_update(self, _req=None) -> bool:
        """The update in progress ends at ``finish_weight_update`` without a flip: the
        registered memory gets the served version back, no rollback target remains."""
        self._require_shadow("discard")
        self._discard = True
        return True

    def _rollback(self, _req=None) -> bool:
        """Back to the version before the last flip: the registered memory and the standby
        swap, then the flip runs. The standby then holds the version rolled back from,
        which is not a rollback target (one step back only)."""
        self._require_shadow("rollback")
        if not self._standby.held:
            raise ValueError(f"{self.owner}: rollback: no previous version held (fewer than "
                             "two updates have flipped since setup, or the last one was "
                             "discarded)")
        t0 = time.perf_counter()
        self._standby.swap()
        self._standby.held = False
        flip_live(self._shadow, self._repack)
        self._complete = True
        log.info("%s: rolled back in %.3f s", self.owner, time.perf_counter() - t0)
        return True

    def _require_shadow(self, what: str) -> None:
        if self.apply != "shadow" or self._standby is None:
            raise ValueError(f"{self.owner}: {what} needs apply='shadow' at setup "
                             f"(this engine was registered with apply={self.apply!r})")


    def _deregister(self, _req=None) -> int:
        return self.mem.deregister()

    def _delta_arena(self, slots) -> Any:
        """Register (once; again only for other slots) the delta arena; its region."""
        arena = self._delta
        if arena is not None and arena.fits(slots) and arena.region is not None:
            return arena.region
        if arena is not None:
            arena.deregister()
        if self.meta is None:
            raise RuntimeError(f"{self.owner}: delta_arena before setup")
        self._delta = DeltaArena(slots, owner=self.owner)
        return self._delta.register(self.mem.nics[self.meta.nic])

    def _delta_apply(self, req) -> DeltaApplied:
        """Apply ``(version, held)``'s records in place (before finish_weight_update)."""
        version, held = req
        if self._delta is None:
            raise RuntimeError(f"{self.owner}: delta_apply without a delta arena")
        return self._delta.apply(version=version, held=held, buffers=self.mem.buffers)

    def _close(self, _req=None) -> None:
        for name in list(self.lora):
            LORA_OPS["lora_close"](self, name)
        if self._delta is not None:
            self._delta.deregister()
            self._delta = None
        self.mem.close()
        self.views = {}
        self._shadow = self._standby = None
        self._complete = False

    # ------------------------------------------------------------------ vLLM's update hooks

    def start_weight_update(self) -> None:
        self._discard = False
        self._staging = True
        if self._standby is not None:  # shadow: keep the version served, for a rollback
            self._standby.save(complete=self._complete)
        self.mem.open_window()  # tcp: planned writes accepted from now until the finish
        log.debug("%s: update started (the trainers write now)", self.owner)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.parse_update_info(update_info)  # nothing travels through vLLM

    def receive_weights(self, update_info: OneSidedUpdateInfo) -> None:
        pass

    def finish_weight_update(self) -> None:
        self.mem.close_window()  # tcp: no write lands once the update is finished
        self._staging = False
        if self._discard:
            self._standby.restore()
            self._standby.held = self._discard = False
            log.info("%s: update discarded; live memory untouched", self.owner)
            return
        t0 = time.perf_counter()
        flip_live(self._shadow, self._repack)
        self._complete = True
        self.finished += 1
        log.info("%s: update finished, %d layers reprocessed in %.3f s", self.owner,
                 len(self._repack), time.perf_counter() - t0)

    def shutdown(self) -> None:
        self._close()


def flip_live(shadow: DirectShadow | None, repack: dict) -> None:
    """Live memory receives the registered version: the direct parameters' copy (shadow
    mode), then vLLM's reprocessing of the repacked layers from the arena."""
    if shadow is not None:
        shadow.flip()
    if repack:
        reprocess(repack)


def _run_op(backend: OneSidedBackend, op: str, request: Any) -> Any:
    handler = _OPS.get(op)
    if handler is None:
        raise ValueError(f"unknown operation {op!r}; known: {sorted(_OPS)}")
    return handler(backend, request)


_OPS = {
    "setup": OneSidedBackend._setup,
    "endpoints": OneSidedBackend._endpoints,
    "connect": OneSidedBackend._connect,
    "copy_to": OneSidedBackend._copy_to,
    "stats": OneSidedBackend._stats,
    "checksum": OneSidedBackend._checksum,
    "deregister": OneSidedBackend._deregister,
    "memory": OneSidedBackend._memory,
    "live_checksum": OneSidedBackend._live_checksum,
    "discard": OneSidedBackend._discard_update,
    "rollback": OneSidedBackend._rollback,
    "close": OneSidedBackend._close,
    "delta_arena": OneSidedBackend._delta_arena,
    "delta_apply": OneSidedBackend._delta_apply,
    **LORA_OPS,  # LoRA adapters in vLLM's slots (.lora.slots)
}
