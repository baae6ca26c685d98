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
* ``stats``, ``deregister``, ``close``.

An update: ``start_weight_update`` (nothing to do: the driver has stopped
scheduling steps), the trainers' one-sided writes (this code does not run),
``finish_weight_update``: reprocess the repacked layers with vLLM's own
functions. ``update_weights`` carries no data and is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weight_transfer.engines.vllm.mailbox import Failure, read_request, write_reply
from weight_transfer.engines.vllm.memory import Arena, reprocess, reprocessed, storage_bytes
from weight_transfer.engines.vllm.recording import exposed_shapes, record_load
from weight_transfer.recording import checkpoint as ckpt
from weight_transfer.transport.handshake import answer_requests, connect_peers
from weight_transfer.types import EngineRankMeta, EngineTensorMeta, ShardSpec

log = logging.getLogger(__name__)


@dataclass
class OneSidedInitInfo(WeightTransferInitInfo):
    op: str = "setup"
    mailbox: str = ""
    seq: int = 0
    rank: int = -1  # the TP rank that acts; -1: every rank


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
        self.meta: EngineRankMeta | None = None
        self.nics: dict[str, Any] = {}
        self._repack: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
        self._arena: Arena | None = None
        self.views: dict[str, torch.Tensor] = {}  # registered tensor -> its memory (checks)
        self._regions: dict[int, torch.Tensor] = {}  # region address -> its bytes
        self.finished = 0

    @property
    def owner(self) -> str:
        return f"{self.meta.replica if self.meta else '?'}/tp{self.shard.tp_rank}"

    # ------------------------------------------------------------------ operations

    def init_transfer_engine(self, init_info: OneSidedInitInfo) -> None:
        if init_info.rank not in (-1, self.shard.tp_rank):
            return
        handler = _OPS.get(init_info.op)
        try:
            if handler is None:
                raise ValueError(f"unknown operation {init_info.op!r}; known: {sorted(_OPS)}")
            value = handler(self, read_request(init_info.mailbox, init_info.seq))
        except Exception as exc:  # the driver raises it, naming this rank
            log.exception("%s: %s failed", self.owner, init_info.op)
            value = Failure(kind=type(exc).__name__, message=str(exc),
                            trace=traceback.format_exc())
        write_reply(init_info.mailbox, init_info.seq, self.shard.tp_rank, value)

    def _setup(self, req) -> EngineRankMeta:
        if self.meta is not None:
            if req.transport != self._spec:
                raise ValueError(f"{self.owner}: memory is registered with "
                                 f"{self._spec.describe()} NICs; close first")
            return self.meta
        t0 = time.perf_counter()
        checkpoint = req.checkpoint or ckpt.checkpoint_specs(self.model_config.model)
        layout = record_load(self.model, checkpoint=checkpoint, device=self.device)
        exposed = exposed_shapes(layout)
        self._spec, self.replica = req.transport, req.replica
        owner = f"{req.replica}/tp{self.shard.tp_rank}"
        buffers = self._buffers(layout, exposed)
        nics = req.nics[self.shard.tp_rank]
        tensors = []
        for i, (buf, entries) in enumerate(buffers):
            name = nics[i % len(nics)]
            if name not in self.nics:
                self.nics[name] = req.transport.open(owner=owner, nic=name, node=req.node,
                                                     address=req.address)
            region = self.nics[name].register(buf)
            self._regions[region.addr] = buf
            tensors += [EngineTensorMeta(name=s.name, shape=s.shape, dtype=s.dtype,
                                         region=region, offset=off) for s, off in entries]
        self.meta = EngineRankMeta(replica=req.replica, rank=self.shard.tp_rank, node=req.node,
                                   nic=nics[0], shard=self.shard, tensors=tuple(tensors),
                                   pieces=layout.pieces)
        log.info("%s: %d tensors (%d in the repack arena) registered in %.2f s", owner,
                 len(tensors), len(self._arena or ()), time.perf_counter() - t0)
        return self.meta

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
        return answer_requests(self.nics, requests, owner=self.owner)

    def _connect(self, conns):
        return connect_peers(self.nics, conns, owner=self.owner)

    def _copy_to(self, dst: EngineRankMeta) -> int:
        from weight_transfer.engine_copy import copy_jobs

        jobs = copy_jobs(self.meta, dst, self.nics, owner=self.owner)

        async def run() -> None:
            await asyncio.gather(*(nic.write(src, region, 0) for nic, src, region in jobs))

        asyncio.run(run())
        return sum(region.length for _, _, region in jobs)

    def _stats(self, _req=None) -> dict[str, int]:
        nics = self.nics.values()
        return {"bytes_written": sum(getattr(n, "bytes_written", 0) for n in nics),
                "writes": sum(getattr(n, "writes", 0) for n in nics),
                "finished": self.finished}

    def _checksum(self, ranges) -> Any:
        """XXH3-64 of (region address, offset, length) rows of the registered memory (the
        controller's integrity check, while the engine is paused)."""
        from weight_transfer.integrity import checksum_ranges

        return checksum_ranges(self._regions, ranges)

    def _deregister(self, _req=None) -> int:
        regions = list(dict.fromkeys(t.region for t in self.meta.tensors))
        for region in regions:
            self.nics[region.nic].deregister(region)
        return len(regions)

    def _close(self, _req=None) -> None:
        for nic in self.nics.values():
            nic.close()
        self.nics, self.meta, self.views, self._regions = {}, None, {}, {}

    # ------------------------------------------------------------------ vLLM's update hooks

    def start_weight_update(self) -> None:
        log.debug("%s: update started (the trainers write now)", self.owner)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.parse_update_info(update_info)  # nothing travels through vLLM

    def receive_weights(self, update_info: OneSidedUpdateInfo) -> None:
        pass

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        if self._repack:
            reprocess(self._repack)
        self.finished += 1
        log.info("%s: update finished, %d layers reprocessed in %.3f s", self.owner,
                 len(self._repack), time.perf_counter() - t0)

    def shutdown(self) -> None:
        self._close()


_OPS = {
    "setup": OneSidedBackend._setup,
    "endpoints": OneSidedBackend._endpoints,
    "connect": OneSidedBackend._connect,
    "copy_to": OneSidedBackend._copy_to,
    "stats": OneSidedBackend._stats,
    "checksum": OneSidedBackend._checksum,
    "deregister": OneSidedBackend._deregister,
    "close": OneSidedBackend._close,
}
