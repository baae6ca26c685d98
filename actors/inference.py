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
(:mod:`actors.controller.engine_control`). ``wt_copy_to(meta)`` writes this
rank's registered buffers into the same layout of another replica, connected
the same way (a new replica fetches a version from a peer). After an update the
controller may ask ``wt_checksum(ranges)``: the checksums of written ranges of the
registered memory, to compare with the trainers' (:mod:`actors.controller.checks`).

``InferenceActor`` holds a :class:`~weight_transfer.engines.reference.engine.ReferenceEngine`
for one (replica, TP rank), with a gloo group over its replica's TP ranks, and
offers ``generate`` and ``logits`` (every TP rank of the replica calls together).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from actors.connections import this_host
from weight_transfer.engines.delta_rank import DeltaRankMixin
from weight_transfer.engines.fence import EVENTS_KEPT, KEEP, CommandFence  # noqa: F401
from weight_transfer.engines.gpu_flush import flush_gpudirect_writes
from weight_transfer.engines.registered import RegisteredMemory
from weight_transfer.engines.shadow.rank import ShadowControl
from weight_transfer.engines.shadow.store import ShadowError, ShadowInfo
from weight_transfer.layout.engine_copy import layout_key, regions_of  # noqa: F401 (re-exported)
from weight_transfer.transport.handshake import Connection, HostId, InfoRequest
from weight_transfer.transport.options import DEFAULT_TRANSPORT, TransportSpec
from weight_transfer.types import (
    EngineRankId,
    EngineRankMeta,
    NicId,
    PeerInfo,
    ShardSpec,
)

log = logging.getLogger(__name__)


def engine_name(adapter: Any) -> str:
    """The engine an adapter fronts, for messages (``ReferenceEngineAdapter`` -> reference)."""
    name = getattr(adapter, "engine_name", None)
    return name if isinstance(name, str) else type(adapter).__name__


class InferenceMixin(DeltaRankMixin):
    """Weight-transfer methods for an inference actor (an
    :class:`~weight_transfer.engines.rank.EngineRank`); see the module docstring."""

    _wt_adapter: Any = None

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
        self._wt_default_spec = transport or DEFAULT_TRANSPORT
        self._wt_mem = RegisteredMemory(self._wt_owner)
        self._wt_fence = CommandFence(self._wt_owner)
        self._wt_lock = threading.Lock()  # one registration at a time
        self._wt_shadow = ShadowControl(self._wt_owner, engine_name(adapter),
                                        fence=self._wt_fence, mem=self._wt_mem, boundary=adapter)

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
            self._wt_mem.check_spec(transport)
            if self._wt_mem.meta is None:
                shadow = self._wt_shadow
                self._wt_mem.register(
                    transport or self._wt_default_spec,
                    shadow.copy.region_buffers() if shadow.enabled
                    else self._wt_adapter.region_buffers(),
                    nic_names=self._wt_nic_names, node=self.wt_node_id(),
                    address=self.wt_host().address, replica=self._wt_replica,
                    rank=self._wt_rank, shard=self._wt_shard,
                    served_by_flip=shadow.enabled)
                if shadow.enabled:
                    shadow.bind()
            return self._wt_mem.meta

    def wt_host(self) -> HostId:
        """The host this rank runs on (hostname and address; a simnic reaches only its own)."""
        return this_host()

    def wt_node_id(self) -> str:
        """The Ray node this rank runs on (the plan's ``node``; not a host: see wt_host)."""
        return ray.get_runtime_context().get_node_id()

    def wt_endpoints(self, requests: list[InfoRequest]) -> tuple[PeerInfo, ...]:
        """Connection set-up, round 1: this rank's peer info for each remote NIC named."""
        self.wt_engine_meta()
        return self._wt_mem.endpoints(requests)

    def wt_connect_peers(self, conns: list[Connection]) -> int:
        """Connection set-up, round 2: connect these NICs to the peer infos made for them."""
        self.wt_engine_meta()
        return self._wt_mem.connect(conns)

    # ------------------------------------------------------------------ pause and versions

    def wt_pause(self, timeout_s: float = 60.0, epoch: int | None = None) -> bool:
        """Hold generation at its next step boundary; returns once no step runs.

        ``epoch`` (the controller's, see :mod:`actors.controller.engine_control`): a pause
        older than the newest command seen is ignored (returns False); a fenced
        pause comes before writes or holds a torn replica, so the version held
        becomes None until a resume names one.
        """
        self._wt_require()
        if not self._wt_fence.pause(epoch, stop=self._wt_adapter.pause):
            return False
        self._wt_mem.open_window()  # tcp: planned writes accepted from now until the resume
        wait_idle = getattr(self._wt_adapter, "wait_idle", None)
        if wait_idle is not None and not wait_idle(timeout_s):
            raise TimeoutError(f"{self._wt_owner}: a generation step still runs "
                               f"{timeout_s:g} s after pause()")
        self._wt_fence.record("pause")
        return True

    def wt_resume(self, version: Any = KEEP, epoch: int | None = None,
                  deadline: float | None = None) -> bool:
        """Record ``version`` (if given) as the weights now held, then let generation go on.

        Refused (returns False, the rank stays paused) when ``epoch`` is older
        than the newest command seen or ``time.time()`` is past ``deadline``:
        the controller gave up waiting for this resume and held the replica.
        """
        self._wt_require()

        def go() -> None:
            self._wt_mem.close_window()  # tcp: no write lands once the engine serves
            flush_gpudirect_writes(self._wt_device())  # GPU: writes visible to kernels
            self._wt_fence.record("resume")
            self._wt_adapter.resume()

        return self._wt_fence.resume(version, epoch, deadline, go)

    def wt_paused(self) -> bool:
        self._wt_require()
        return bool(self._wt_adapter.paused)

    def wt_set_version(self, version: int | None, epoch: int | None = None) -> bool:
        """Record the version held (no pause: ``pause_during_update`` off); fenced as
        :meth:`wt_pause`."""
        return self._wt_fence.set_version(version, epoch)

    def wt_version(self) -> int | None:
        return self._wt_fence.version

    def wt_events(self) -> list[tuple[str, int | None, float]]:
        """(event, version held, time.time()) of every pause, resume and version change."""
        return self._wt_fence.events()

    def _wt_device(self) -> Any:
        """The device of the registered memory (None: none registered yet)."""
        buf = next(iter(self._wt_mem.buffers.values()), None)
        return getattr(buf, "device", None)

    # ------------------------------------------------------------------ shadow mode

    def wt_shadow_setup(self, transport: TransportSpec | None = None) -> ShadowInfo:
        """Allocate the shadow (the adapter's ``shadow_buffers()``) and register it instead
        of the live memory (regions registered in place before are closed first);
        ShadowError naming the engine when its adapter cannot give a second copy."""
        self._wt_require()
        make = getattr(self._wt_adapter, "shadow_buffers", None)
        if make is None:
            raise ShadowError(f"{self._wt_owner}: the {engine_name(self._wt_adapter)} engine "
                              "cannot hold a shadow copy of its weights (its adapter has no "
                              "shadow_buffers()); use TransferConfig.apply='in_place'")
        with self._wt_lock:
            if not self._wt_shadow.enabled:
                if self._wt_mem.meta is not None:  # registered in place: expose the shadow
                    self._wt_mem.close()
                self._wt_shadow.setup(self._wt_adapter.region_buffers(), make())
        self.wt_engine_meta(transport)
        return self._wt_shadow.info()

    def wt_shadow_info(self) -> ShadowInfo:
        return self._wt_shadow.info()

    def wt_stage(self, version: Any, epoch: int | None = None, base: bool = False) -> bool:
        return self._wt_shadow.stage(version, epoch, base)

    def wt_flip(self, version: Any, epoch: int | None = None,
                deadline: float | None = None) -> bool:
        return self._wt_shadow.flip(version, epoch, deadline)

    def wt_rollback(self, epoch: int | None = None, deadline: float | None = None) -> bool:
        return self._wt_shadow.rollback(epoch, deadline)

    def wt_discard_shadow(self, epoch: int | None = None) -> bool:
        return self._wt_shadow.discard(epoch)

    def wt_live_checksum(self, ranges: np.ndarray) -> np.ndarray:
        self.wt_engine_meta()
        if not self._wt_shadow.enabled:
            return self._wt_mem.checksum(ranges)
        return self._wt_shadow.live_checksum(ranges)

    # ------------------------------------------------------------------ peers and checks

    def wt_copy_to(self, dst: EngineRankMeta) -> int:
        """Write this rank's registered buffers into ``dst`` (same layout); returns bytes.
        The NICs must be connected to ``dst``'s first (:meth:`wt_connect_peers`)."""
        self.wt_engine_meta()
        shadow = self._wt_shadow
        return self._wt_mem.copy_to(dst, shadow.source_addr if shadow.enabled else None)

    def wt_checksum(self, ranges: np.ndarray) -> np.ndarray:
        """XXH3-64 of each (region addr, offset, length) row of ``ranges`` in this rank's
        registered memory (:func:`weight_transfer.integrity.checksums.checksum_ranges`)."""
        self.wt_engine_meta()
        return self._wt_mem.checksum(ranges)

    def wt_nic_stats(self) -> dict[str, int]:
        return self._wt_mem.stats()

    def wt_transport(self) -> str | None:
        """The transport of this rank's NICs (``simnic``, ``mooncake``, ``rdma``), once open."""
        return None if self._wt_mem.spec is None else self._wt_mem.spec.kind

    def wt_close(self) -> None:
        self.wt_delta_close()
        self._wt_mem.close()


# Threaded, so wt_resume can reach an engine whose generate() waits at a paused step.
