"""One engine rank's registered memory: its NICs, its regions, and what runs on them.

Whatever the engine (the reference engine's actor, a vLLM worker), a rank
registers the buffers its engine computes with, once, with NICs of the
transport the controller names, and then answers the connection set-up, peer
copies, checksums and statistics over the same NICs::

    mem = RegisteredMemory("engine0/tp1")
    meta = mem.register(spec, buffers, nic_names=["inode0/nic0"], node=node, address=addr,
                        replica="engine0", rank=1, shard=shard)
    mem.endpoints(requests); mem.connect(conns)        # two rounds of connection set-up
    mem.copy_to(other_meta)                            # this rank's bytes into another replica
    mem.checksum(ranges)                               # the controller's integrity check
    mem.open_window(); mem.close_window()              # at the pause / resume of an update
    mem.stats(); mem.close()

``buffers`` are ``(buffer, entries)`` pairs, each entry ``(name, shape, dtype,
byte offset)`` of one tensor inside the buffer (an
:class:`~weight_transfer.engines.adapter.EngineAdapter`'s ``region_buffers()``);
buffer ``i`` is registered with NIC ``nic_names[i % len(nic_names)]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from weight_transfer.integrity.checksums import checksum_ranges
from weight_transfer.integrity.receipt import check_engine_meta
from weight_transfer.layout.engine_copy import copy_jobs, regions_of
from weight_transfer.transport.handshake import answer_requests, connect_peers
from weight_transfer.types import EngineRankMeta, EngineTensorMeta, Piece, ShardSpec

log = logging.getLogger(__name__)


def byte_view(buf: Any) -> Any:
    """A flat uint8 view of registered memory (a tensor, an array or a buffer)."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    return np.frombuffer(buf, dtype=np.uint8) if not hasattr(buf, "__array_interface__") \
        else np.asarray(buf).reshape(-1).view(np.uint8)


class RegisteredMemory:
    """See the module docstring. Not thread-safe: the caller serializes (re)registration."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.nics: dict[str, Any] = {}  # NIC name -> Transport
        self.buffers: dict[int, Any] = {}  # region addr -> its bytes (uint8)
        self.meta: EngineRankMeta | None = None
        self.spec: Any = None  # the TransportSpec of the NICs, once registered

    def register(self, spec: Any, buffers: Iterable[tuple[Any, Sequence[tuple]]], *,
                 nic_names: Sequence[str], node: str, address: str, replica: str, rank: int,
                 shard: ShardSpec, pieces: tuple[Piece, ...] | None = None,
                 served_by_flip: bool = False) -> EngineRankMeta:
        """Register every buffer (NICs opened on first use, kept after a revocation) and
        describe them; the result is also :attr:`meta` (``served_by_flip``: the buffers are
        a copy served only after a flip, :class:`~weight_transfer.types.EngineRankMeta`)."""
        if not nic_names:
            raise ValueError(f"{self.owner}: needs at least one NIC name")
        self.spec = spec
        tensors = []
        for i, (buf, entries) in enumerate(buffers):
            name = nic_names[i % len(nic_names)]
            nic = self.nics.get(name)
            if nic is None:
                nic = self.nics[name] = spec.open(owner=self.owner, nic=name, node=node,
                                                  address=address)
            region = nic.register(buf)
            self.buffers[region.addr] = byte_view(buf)
            tensors += [EngineTensorMeta(name=n, shape=tuple(shape), dtype=dtype, region=region,
                                         offset=offset) for n, shape, dtype, offset in entries]
        log.info("%s registered %d tensors in %d regions", self.owner, len(tensors),
                 len(self.buffers))
        self.meta = EngineRankMeta(replica=replica, rank=rank, node=node, nic=nic_names[0],
                                   shard=shard, tensors=tuple(tensors), pieces=pieces,
                                   served_by_flip=served_by_flip)
        return self.meta

    def require(self) -> EngineRankMeta:
        if self.meta is None:
            raise RuntimeError(f"{self.owner}: no memory registered yet")
        return self.meta

    def check_spec(self, spec: Any) -> None:
        """ValueError unless the memory is registered with NICs of ``spec`` (or not at all)."""
        if self.meta is not None and spec is not None and spec != self.spec:
            raise ValueError(
                f"{self.owner}: buffers are registered with {self.spec.describe()} NICs, not "
                f"{spec.describe()}; wt_close() first to change transport")

    def endpoints(self, requests: list) -> tuple:
        """Connection set-up, round 1: this rank's peer info for each remote NIC named."""
        return answer_requests(self.nics, requests, owner=self.owner)

    def connect(self, conns: list) -> int:
        """Connection set-up, round 2: connect these NICs to the peer infos made for them."""
        return connect_peers(self.nics, conns, owner=self.owner)

    def copy_to(self, dst: EngineRankMeta,
                source_addr: Callable[[int], int] | None = None) -> int:
        """Write every registered buffer into ``dst`` (same layout); returns bytes. The NICs
        must be connected to ``dst``'s first (:meth:`connect`). ``source_addr``: where the
        bytes behind each registered region's address are read from instead (shadow mode:
        the live copy)."""
        mine = self.require()
        check_engine_meta(dst, f"{self.owner}: copy target")  # on receipt
        jobs = copy_jobs(mine, dst, self.nics, owner=self.owner)
        if source_addr is not None:
            jobs = [(nic, (source_addr(addr), n), region) for nic, (addr, n), region in jobs]

        async def run() -> None:
            await asyncio.gather(*(nic.write(src, region, 0) for nic, src, region in jobs))

        asyncio.run(run())
        nbytes = sum(region.length for _, _, region in jobs)
        log.info("%s copied %d B into %s/tp%d", self.owner, nbytes, dst.replica, dst.rank)
        return nbytes

    def checksum(self, ranges: np.ndarray, buffers: Mapping[int, Any] | None = None
                 ) -> np.ndarray:
        """XXH3-64 of each (region addr, offset, length) row of ``ranges``
        (:func:`~weight_transfer.integrity.checksums.checksum_ranges`); ``buffers``: the bytes
        to hash per registered region address instead (shadow mode: the live copy)."""
        self.require()
        return checksum_ranges(self.buffers if buffers is None else buffers, ranges)

    def tensor_bytes(self, tensor: str) -> Any:
        """The registered bytes of ``tensor`` (a uint8 view); ValueError naming it if unknown."""
        t = next((t for t in self.require().tensors if t.name == tensor), None)
        if t is None:
            raise ValueError(f"{self.owner}: no registered tensor {tensor!r}")
        return self.buffers[t.region.addr][t.offset:t.offset + t.nbytes]

    def stats(self) -> dict[str, int]:
        """Bytes and writes the NICs delivered, and connections and writes they refused."""
        nics = self.nics.values()
        return {key: sum(getattr(n, key, 0) for n in nics)
                for key in ("bytes_written", "writes", "refused_connections", "refused_writes")}

    def open_window(self) -> None:
        """The engine paused for an update: NICs that enforce an update window (tcp)
        accept planned writes until :meth:`close_window`."""
        for nic in self.nics.values():
            nic.open_window()

    def close_window(self) -> None:
        """The engine resumes: writes are refused again (returns once none is copied)."""
        for nic in self.nics.values():
            nic.close_window()

    def deregister(self) -> int:
        """Revoke every registered region (later writes into it fail); returns how many.
        The description stays until :meth:`forget`."""
        regions = regions_of(self.require())
        for region in regions:
            self.nics[region.nic].deregister(region)
        return len(regions)

    def forget(self) -> None:
        """Drop the description; the NICs stay open and :meth:`register` again gives new
        regions (new rkeys)."""
        self.meta = None

    def close(self) -> None:
        for nic in self.nics.values():
            nic.close()
        self.nics, self.buffers, self.meta, self.spec = {}, {}, None, None
