"""Inference side: a mixin that gives a rollout actor the weight-transfer methods, and
``InferenceActor``, a ready-made reference-engine rank that uses it.

The engine is not modified: the mixin needs only an
:class:`~weight_transfer.engines.reference.adapter.EngineAdapter` (the engine's weight
buffers, and pause/resume hooks)::

    class MyRollout(InferenceMixin):
        def __init__(self, ...):
            ...                                             # build the engine
            self.wt_attach_engine(adapter=ReferenceEngineAdapter(engine), replica="engine0",
                                  rank=tp_rank, shard=shard,
                                  nics=[cluster.engine_nic(replica_index, tp_rank)])

At setup the controller gathers ``wt_engine_meta(transport)`` (the engine's
buffers registered with one NIC of the configured transport, built through the
registry, per NIC the cluster gives this rank: real addresses, lengths and
rkeys) and ``wt_host()``; then, for the two-way connection set-up,
``wt_endpoints(requests)`` (this rank's peer info made for each trainer NIC
named) and ``wt_connect_peers(conns)`` (connect to the trainers' infos made
for these NICs). During an update the rank runs no code: trainers write
straight into the registered memory; the controller only calls ``wt_pause()``
before and ``wt_resume(version)`` after, each with an epoch that fences
stale commands: a rank ignores a command older than the newest it has seen and
refuses a resume that comes after its deadline, so a rank that was stopped
while the controller gave up on it does not resume serving when it continues
(:mod:`actors.engine_control`). ``wt_copy_to(meta)`` writes this
rank's registered buffers into the same layout of another replica, connected
the same way (a new replica fetches a version from a peer). After an update the
controller may ask ``wt_checksum(ranges)``: the checksums of written ranges of the
registered memory, to compare with the trainers' (:mod:`actors.integrity_check`).

``InferenceActor`` holds a :class:`~weight_transfer.engines.reference.engine.ReferenceEngine`
for one (replica, TP rank), with a gloo group over its replica's TP ranks, and
offers ``generate`` and ``logits`` (every TP rank of the replica calls together).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from actors.config import TransferConfig
from actors.connections import this_host
from actors.groups import GroupMember, connect_store, join_gloo_group
from weight_transfer.engine_copy import copy_jobs, layout_key, regions_of  # noqa: F401
from weight_transfer.integrity import checksum_ranges
from weight_transfer.receipt import check_engine_meta
from weight_transfer.transport.handshake import (
    Connection,
    HostId,
    InfoRequest,
    answer_requests,
    connect_peers,
)
from weight_transfer.transport.options import DEFAULT_TRANSPORT, TransportSpec
from weight_transfer.types import (
    EngineRankId,
    EngineRankMeta,
    EngineTensorMeta,
    NicId,
    PeerInfo,
    ShardSpec,
)

log = logging.getLogger(__name__)

_KEEP = object()
EVENTS_KEPT = 1024  # wt_events() keeps this many latest pause/resume/version events


def _byte_view(buf: Any) -> Any:
    """A flat uint8 view of registered memory (a tensor, an array or a buffer)."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    return np.frombuffer(buf, dtype=np.uint8) if not hasattr(buf, "__array_interface__") \
        else np.asarray(buf).reshape(-1).view(np.uint8)


class InferenceMixin:
    """Weight-transfer methods for an inference actor; see the module docstring."""

    _wt_adapter: Any = None
    _wt_meta: EngineRankMeta | None = None

    def wt_attach_engine(
        self, *, adapter: Any, replica: str, rank: int, shard: ShardSpec, nics: Sequence[NicId],
        transport: TransportSpec | None = None,
    ) -> None:
        """Declare the engine (through its adapter) and the NICs this rank may use (from the
        cluster config: ``cluster.engine_nic(replica_index, rank)``);
        ``transport``: the NICs' default until the controller names one (else simnic)."""
        if not nics:
            who = EngineRankId(replica=replica, rank=rank)
            raise ValueError(f"{who}: needs at least one NIC name")
        self._wt_adapter, self._wt_replica, self._wt_rank = adapter, replica, rank
        self._wt_shard, self._wt_nic_names = shard, [str(n) for n in nics]  # names on the wire
        self._wt_nics: dict[str, Any] = {}  # NIC name -> Transport
        self._wt_buffers: dict[int, torch.Tensor] = {}  # region addr -> its bytes (uint8)
        self._wt_spec: TransportSpec | None = None
        self._wt_default_spec = transport or DEFAULT_TRANSPORT
        self._wt_meta = None
        self._wt_version: int | None = None
        # The latest events only: a long run must not grow the actor's memory.
        self._wt_events: deque[tuple[str, int | None, float]] = deque(maxlen=EVENTS_KEPT)
        self._wt_lock = threading.Lock()
        self._wt_cmd_lock = threading.Lock()  # pause, resume and version commands, fenced
        self._wt_epoch = 0  # the newest controller epoch seen

    @property
    def _wt_owner(self) -> str:
        return str(EngineRankId(replica=self._wt_replica, rank=self._wt_rank))

    def _wt_require(self) -> None:
        if self._wt_adapter is None:
            raise RuntimeError(f"{type(self).__name__}: call wt_attach_engine() first")

    def wt_engine_meta(self, transport: TransportSpec | None = None) -> EngineRankMeta:
        """Register the engine's buffers (once, with NICs of ``transport``; default: the one
        given to :meth:`wt_attach_engine`) and describe them: real regions, offsets."""
        self._wt_require()
        with self._wt_lock:
            if self._wt_meta is None:
                self._wt_meta = self._wt_register(transport or self._wt_default_spec)
            elif transport is not None and transport != self._wt_spec:
                raise ValueError(
                    f"{self._wt_owner}: buffers are registered with {self._wt_spec.describe()} "
                    f"NICs, not {transport.describe()}; wt_close() first to change transport")
            return self._wt_meta

    def wt_host(self) -> HostId:
        """The host this rank runs on (hostname and address; a simnic reaches only its own)."""
        return this_host()

    def wt_node_id(self) -> str:
        """The Ray node this rank runs on (the plan's ``node``; not a host: see wt_host)."""
        return ray.get_runtime_context().get_node_id()

    def _wt_register(self, spec: TransportSpec) -> EngineRankMeta:
        node = self.wt_node_id()
        address = self.wt_host().address
        self._wt_spec = spec
        tensors = []
        for i, (buf, entries) in enumerate(self._wt_adapter.region_buffers()):
            name = self._wt_nic_names[i % len(self._wt_nic_names)]
            nic = self._wt_nics.get(name)
            if nic is None:
                nic = self._wt_nics[name] = spec.open(owner=self._wt_owner, nic=name, node=node,
                                                      address=address)
            region = nic.register(buf)
            self._wt_buffers[region.addr] = _byte_view(buf)
            tensors += [EngineTensorMeta(name=n, shape=tuple(shape), dtype=dtype, region=region,
                                         offset=offset) for n, shape, dtype, offset in entries]
        log.info("%s registered %d tensors in %d regions", self._wt_owner, len(tensors),
                 len(self._wt_nics))
        return EngineRankMeta(replica=self._wt_replica, rank=self._wt_rank, node=node,
                              nic=self._wt_nic_names[0], shard=self._wt_shard,
                              tensors=tuple(tensors))

    def wt_endpoints(self, requests: list[InfoRequest]) -> tuple[PeerInfo, ...]:
        """Connection set-up, round 1: this rank's peer info for each remote NIC named."""
        self.wt_engine_meta()
        return answer_requests(self._wt_nics, requests, owner=self._wt_owner)

    def wt_connect_peers(self, conns: list[Connection]) -> int:
        """Connection set-up, round 2: connect these NICs to the peer infos made for them."""
        self.wt_engine_meta()
        return connect_peers(self._wt_nics, conns, owner=self._wt_owner)

    # ------------------------------------------------------------------ pause and versions

    def _wt_log(self, event: str) -> None:
        self._wt_events.append((event, self._wt_version, time.time()))

    def _wt_fence(self, epoch: int | None, what: str) -> bool:
        """Whether a command of ``epoch`` is current (None: unfenced, from a user); call under
        ``_wt_cmd_lock``. A command older than the newest one seen is ignored."""
        if epoch is None:
            return True
        if epoch < self._wt_epoch:
            log.warning("%s ignored a stale %s (epoch %d < %d)", self._wt_owner, what, epoch,
                        self._wt_epoch)
            self._wt_log(f"stale {what}")
            return False
        self._wt_epoch = epoch
        return True

    def wt_pause(self, timeout_s: float = 60.0, epoch: int | None = None) -> bool:
        """Hold generation at its next step boundary; returns once no step runs.

        ``epoch`` (the controller's, see :mod:`actors.engine_control`): a pause
        older than the newest command seen is ignored (returns False); a fenced
        pause comes before writes or holds a torn replica, so the version held
        becomes None until a resume names one.
        """
        self._wt_require()
        with self._wt_cmd_lock:
            if not self._wt_fence(epoch, "pause"):
                return False
            if epoch is not None:
                self._wt_version = None
            self._wt_adapter.pause()
        wait_idle = getattr(self._wt_adapter, "wait_idle", None)
        if wait_idle is not None and not wait_idle(timeout_s):
            raise TimeoutError(f"{self._wt_owner}: a generation step still runs "
                               f"{timeout_s:g} s after pause()")
        self._wt_log("pause")
        return True

    def wt_resume(self, version: Any = _KEEP, epoch: int | None = None,
                  deadline: float | None = None) -> bool:
        """Record ``version`` (if given) as the weights now held, then let generation go on.

        Refused (returns False, the rank stays paused) when ``epoch`` is older
        than the newest command seen or ``time.time()`` is past ``deadline``:
        the controller gave up waiting for this resume and held the replica.
        """
        self._wt_require()
        with self._wt_cmd_lock:
            if not self._wt_fence(epoch, "resume"):
                return False
            if deadline is not None and time.time() > deadline:
                log.warning("%s refused a resume to version %s that came %.3f s after its "
                            "deadline", self._wt_owner, version, time.time() - deadline)
                self._wt_log("late resume")
                return False
            if version is not _KEEP:
                self._wt_version = version
            self._wt_log("resume")
            self._wt_adapter.resume()
        return True

    def wt_paused(self) -> bool:
        self._wt_require()
        return bool(self._wt_adapter.paused)

    def wt_set_version(self, version: int | None, epoch: int | None = None) -> bool:
        """Record the version held (no pause: ``pause_during_update`` off); fenced as
        :meth:`wt_pause`."""
        with self._wt_cmd_lock:
            if not self._wt_fence(epoch, "version"):
                return False
            self._wt_version = version
            self._wt_log("version")
        return True

    def wt_version(self) -> int | None:
        return self._wt_version

    def wt_events(self) -> list[tuple[str, int | None, float]]:
        """(event, version held, time.time()) of every pause, resume and version change."""
        return list(self._wt_events)

    # ------------------------------------------------------------------ peer copy

    def wt_copy_to(self, dst: EngineRankMeta) -> int:
        """Write this rank's registered buffers into ``dst`` (same layout); returns bytes.
        The NICs must be connected to ``dst``'s first (:meth:`wt_connect_peers`)."""
        mine = self.wt_engine_meta()
        check_engine_meta(dst, f"{self._wt_owner}: copy target")  # on receipt
        jobs = copy_jobs(mine, dst, self._wt_nics, owner=self._wt_owner)

        async def run() -> None:
            await asyncio.gather(*(nic.write(src, region, 0) for nic, src, region in jobs))

        asyncio.run(run())
        nbytes = sum(region.length for _, _, region in jobs)
        log.info("%s copied %d B into %s/tp%d", self._wt_owner, nbytes, dst.replica, dst.rank)
        return nbytes

    # ------------------------------------------------------------------ integrity

    def wt_checksum(self, ranges: np.ndarray) -> np.ndarray:
        """XXH3-64 of each (region addr, offset, length) row of ``ranges`` in this rank's
        registered memory (:func:`weight_transfer.integrity.checksum_ranges`)."""
        self.wt_engine_meta()
        return checksum_ranges(self._wt_buffers, ranges)

    def wt_flip_byte(self, tensor: str, offset: int = 0) -> None:
        """Fault injection: invert one byte of ``tensor`` in the registered memory, as a
        corrupted WRITE would leave it."""
        meta = self.wt_engine_meta()
        t = next((t for t in meta.tensors if t.name == tensor), None)
        if t is None or not 0 <= offset < t.nbytes:
            raise ValueError(f"{self._wt_owner}: no byte {offset} of tensor {tensor!r}")
        buf = self._wt_buffers[t.region.addr]
        buf[t.offset + offset] ^= 0xFF

    def wt_nic_stats(self) -> dict[str, int]:
        nics = self._wt_nics.values()
        return {"bytes_written": sum(n.bytes_written for n in nics),
                "writes": sum(n.writes for n in nics)}

    def wt_transport(self) -> str | None:
        """The transport of this rank's NICs (``simnic``, ``mooncake``, ``rdma``), once open."""
        return None if self._wt_spec is None else self._wt_spec.kind

    def wt_deregister(self) -> None:
        """Fault injection: revoke every registered region (later writes into it fail).
        The next :meth:`wt_engine_meta` registers the buffers again (new rkeys): a later
        ``setup()`` of the controller re-plans with them."""
        meta = self.wt_engine_meta()
        with self._wt_lock:
            for region in regions_of(meta):
                self._wt_nics[region.nic].deregister(region)
            self._wt_meta = None

    def wt_close(self) -> None:
        for nic in self._wt_nics.values():
            nic.close()
        self._wt_nics, self._wt_meta, self._wt_spec = {}, None, None
        self._wt_buffers = {}


class InferenceWorker(InferenceMixin, GroupMember):
    """The ready-made engine rank (``InferenceActor`` is this class as a Ray actor)."""

    def __init__(self, config: TransferConfig, replica: int, local: int) -> None:
        cluster = config.cluster
        if replica >= cluster.inference.replicas:  # a replica added after setup
            cluster = config.with_replicas(replica + 1).cluster
        _, _, self.shard = cluster.engine_rank(replica, local)
        self.config, self.local = config, local
        self.nic_names = [cluster.engine_nic(replica, local)]
        self.replica_name = cluster.replica_name(replica)
        self.tp_size = cluster.inference.gpus_per_replica
        self._store = None
        self.engine = None

    def init_rank(self, host: str, port: int) -> str:
        """Join the replica's gloo group, build the engine; returns this rank's node id."""
        from weight_transfer.engines.reference.adapter import ReferenceEngineAdapter
        from weight_transfer.engines.reference.engine import ReferenceEngine

        if self._store is None:
            self._store = connect_store(host, port, timeout_s=self.config.setup_timeout_s)
        join_gloo_group(self._store, rank=self.local, world=self.tp_size,
                        timeout_s=self.config.setup_timeout_s)
        self.engine = ReferenceEngine(self.config.model, self.shard, fp8=self.config.engine_fp8,
                                      group=dist.group.WORLD)
        self.wt_attach_engine(adapter=ReferenceEngineAdapter(self.engine),
                              replica=self.replica_name, rank=self.local, shard=self.shard,
                              nics=self.nic_names, transport=self.config.transport_spec)
        return self.node_id()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generations (all TP ranks of the replica call together)."""
        return self.engine.generate(prompts, max_new_tokens)

    def logits(self, ids: Any) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (all TP ranks of the replica call together)."""
        return self.engine.forward(torch.as_tensor(ids, dtype=torch.long))

    def engine_state_bytes(self) -> dict[str, torch.Tensor]:
        """Every engine tensor's bytes (for verification only)."""
        return self.engine.state_bytes()


# Threaded, so wt_resume can reach an engine whose generate() waits at a paused step.
InferenceActor = ray.remote(max_concurrency=4)(InferenceWorker)
