"""The ready-made inference rank: the reference engine behind the
:class:`~actors.inference.InferenceMixin` (``InferenceActor`` is it as a Ray actor).

A user with rollout actors of their own adds the mixin to them instead; see
docs/embedding.md.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray
import torch
import torch.distributed as dist

from actors.config import TransferConfig
from actors.groups import GroupMember, connect_store, join_gloo_group
from actors.inference import InferenceMixin
from weight_transfer.engines.fence import EVENTS_KEPT, KEEP, CommandFence  # noqa: F401
from weight_transfer.engines.shadow.rank import store_rendezvous
from weight_transfer.layout.engine_copy import layout_key, regions_of  # noqa: F401 (re-exported)
from weight_transfer.sync.versions import Generation


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
        adapter = ReferenceEngineAdapter(self.engine)
        if self.tp_size > 1:  # a flip's ranks meet before parking (shadow_rank), on a client
            # of their own to the replica's store (the gloo group's stays the group's)
            adapter.rendezvous = store_rendezvous(
                connect_store(host, port, timeout_s=self.config.setup_timeout_s), self.tp_size,
                prefix=f"wt-flip/{self.replica_name}")
        self.wt_attach_engine(adapter=adapter,
                              replica=self.replica_name, rank=self.local, shard=self.shard,
                              nics=self.nic_names, transport=self.config.transport_spec)
        # generate_tagged: the version of each step (a pause does not clear it: no step runs)
        self.engine.version_of = lambda: self._wt_fence.served
        return self.node_id()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generations (all TP ranks of the replica call together)."""
        return self.engine.generate(prompts, max_new_tokens)

    def generate_tagged(self, prompts: list[list[int]], max_new_tokens: int
                        ) -> list[Generation]:
        """:meth:`generate`, each sequence with the weight versions that produced its tokens
        (:class:`weight_transfer.sync.versions.Generation`)."""
        return self.engine.generate_tagged(prompts, max_new_tokens)

    def logits(self, ids: Any) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (all TP ranks of the replica call together)."""
        return self.engine.forward(torch.as_tensor(ids, dtype=torch.long))

    def tagged_logits(self, ids: Any) -> tuple[Any, torch.Tensor]:
        """(version held, :meth:`logits`) computed as one engine step: held back while the
        engine is paused, so never from a version being written (all TP ranks together)."""
        guard = self.engine.step_guard
        with guard() if guard is not None else contextlib.nullcontext():
            return self._wt_fence.served, self.logits(ids)

    def step_times(self, since: float = 0.0) -> list[float]:
        """``time.time()`` at the start of each recent generation step after ``since``
        (``wt bench stall``: the gaps between steps)."""
        return [t for t in list(self._wt_adapter.step_starts) if t > since]

    def engine_state_bytes(self) -> dict[str, torch.Tensor]:
        """Every engine tensor's bytes (for verification only)."""
        return self.engine.state_bytes()


InferenceActor = ray.remote(max_concurrency=4)(InferenceWorker)
