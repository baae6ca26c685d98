"""Adding an engine is one module: a tiny engine registered from this test module only, run
through the unchanged controller.

The engine holds, per rank, a dict of tensors (the shapes and dtypes the
layout of its TP shard names, zeros at start) and implements the
:class:`~weight_transfer.engines.rank.EngineRank` methods on the shared core
(:class:`~weight_transfer.engines.fence.CommandFence`,
:class:`~weight_transfer.engines.registered.RegisteredMemory`). It is
registered under a new name, launched through the registry, and one update
must land, byte for byte, what the reference loader makes of the trainers'
weights.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from actors import TransferConfig, WeightTransferController, launch_trainers
from actors.connections import this_host
from actors.engine_registry import engine_spec, register_engine, unregister_engine
from actors.ready.handles import Launched
from actors.tools.testkit.engine_bytes import engine_mismatches
from weight_transfer.engines.fence import KEEP, CommandFence
from weight_transfer.engines.rank import ENGINE_RANK_METHODS
from weight_transfer.engines.registered import RegisteredMemory
from weight_transfer.layout.engine_layout import engine_tensor_specs
from weight_transfer.sender.prepare import as_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ENGINE = "dict_engine"
# The engine's actor class lives here, in a test module the Ray workers cannot import.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class DictEngineRank:
    """One TP rank of the dict engine: its tensors, and the EngineRank methods on the core."""

    def __init__(self, config: TransferConfig, replica: int, local: int) -> None:
        cluster = config.cluster
        _, nic, self.shard = cluster.engine_rank(replica, local)
        self.replica, self.rank, self.nics = cluster.replica_name(replica), local, [nic]
        self.default_spec = config.transport_spec
        self.tensors = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
                        for s in engine_tensor_specs(config.model, self.shard, fp8=False)}
        owner = f"{self.replica}/tp{local}"
        self.mem, self.fence, self.paused = RegisteredMemory(owner), CommandFence(owner), False
        self.lock = threading.Lock()

    def wt_engine_meta(self, transport: Any = None):
        with self.lock:
            self.mem.check_spec(transport)
            if self.mem.meta is None:
                buffers = [(as_bytes(t).reshape(-1), [(n, tuple(t.shape),
                                                       str(t.dtype).removeprefix("torch."), 0)])
                           for n, t in self.tensors.items()]
                self.mem.register(transport or self.default_spec, buffers, nic_names=self.nics,
                                  node=self.wt_node_id(), address=self.wt_host().address,
                                  replica=self.replica, rank=self.rank, shard=self.shard)
            return self.mem.meta

    def wt_host(self):
        return this_host()

    def wt_node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def wt_endpoints(self, requests: list) -> tuple:
        self.wt_engine_meta()
        return self.mem.endpoints(requests)

    def wt_connect_peers(self, conns: list) -> int:
        self.wt_engine_meta()
        return self.mem.connect(conns)

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused

    def wt_pause(self, timeout_s: float = 60.0, epoch: int | None = None) -> bool:
        return self.fence.pause(epoch, lambda: self._set_paused(True))

    def wt_resume(self, version: Any = KEEP, epoch: int | None = None,
                  deadline: float | None = None) -> bool:
        return self.fence.resume(version, epoch, deadline, lambda: self._set_paused(False))

    def wt_set_version(self, version: Any, epoch: int | None = None) -> bool:
        return self.fence.set_version(version, epoch)

    def wt_version(self) -> Any:
        return self.fence.version

    def wt_paused(self) -> bool:
        return self.paused

    def wt_events(self) -> list:
        return self.fence.events()

    def wt_checksum(self, ranges: np.ndarray) -> np.ndarray:
        self.wt_engine_meta()
        return self.mem.checksum(ranges)

    def wt_copy_to(self, dst: Any) -> int:
        self.wt_engine_meta()
        return self.mem.copy_to(dst)

    def wt_nic_stats(self) -> dict[str, int]:
        return self.mem.stats()

    def wt_transport(self) -> str | None:
        return None if self.mem.spec is None else self.mem.spec.kind

    def wt_close(self) -> None:
        self.mem.close()

    def engine_state_bytes(self) -> dict[str, torch.Tensor]:
        """Every tensor's bytes (for the check)."""
        return {n: as_bytes(t).reshape(-1).clone() for n, t in self.tensors.items()}


DictEngineActor = ray.remote(max_concurrency=4)(DictEngineRank)


def launch_dict_engines(config: TransferConfig, *, replicas: list[int] | None = None
                        ) -> Launched:
    """The engine's launch function (found through the registry): a handle owning it all."""
    inf = config.cluster.inference
    reps = range(inf.replicas) if replicas is None else replicas
    return Launched([[DictEngineActor.options(num_cpus=0).remote(config, r, local)
                      for local in range(inf.gpus_per_replica)] for r in reps],
                    what="dict engines")


def test_the_dict_engine_implements_every_engine_rank_method():
    assert set(dir(DictEngineRank)) >= ENGINE_RANK_METHODS


@pytest.fixture(scope="module")
def registered():
    spec = register_engine(ENGINE, __name__, "launch_dict_engines")
    yield spec
    unregister_engine(ENGINE)


def test_an_engine_registered_here_runs_an_update_through_the_unchanged_controller(
        registered, ray_job, cluster_file):  # on the shared cluster
    # 2 trainer ranks -> 1 replica x TP2: the engine's TP shards, not the fleet's size
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    cluster_file(trainers=2, replicas=1, tp=2),
                                    update_timeout_s=120, barrier_timeout_s=60,
                                    integrity="full")
    with launch_trainers(cfg) as trainers, engine_spec(ENGINE).launcher()(cfg) as replicas:
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        ctl.setup()
        report = ctl.update(1)
        assert report.bytes > 0
        assert ctl.weights_version() == {"engine0": 1}
        assert engine_mismatches(cfg.model, trainers, replicas) == []
        assert ray.get([a.wt_paused.remote() for r in replicas for a in r]) == [False] * 2
        ctl.shutdown()
