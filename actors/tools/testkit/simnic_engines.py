"""Engine regions as byte buffers on simulated NICs in this process, for plans run by the executor.

For unit tests of a source's placements end to end without processes: each engine
rank of the metadata gets a zeroed buffer registered on the simulated NIC its region
names, and one writer NIC is connected to them all. A trainer rank's plan then runs
through the real :class:`~weight_transfer.sender.executor.RankTransfer` (pipeline,
prepare, one-sided writes) from whatever its source would hand the executor, and the
engines' bytes are compared with the reference loader's layout of a full state dict::

    cluster = one_replica_cluster(trainer_ranks=2, tp=2, fp8=fp8)
    with SimnicEngines(engine_metas_from_config(cfg, cluster, fp8=fp8)) as eng:
        plan = compute_plan(trainer_meta, eng.engines, cluster, model=cfg, fp8=fp8)
        report = eng.run(plan, trainer_meta.params, rank, local_tensors.__getitem__)
        assert eng.mismatches(cfg, state, fp8=fp8) == []
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from scheduling.cluster.config import ClusterConfig, cluster_from_dict
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.integrity.checksums import IntegrityPolicy
from weight_transfer.sender.executor import RankTransfer
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.sender.retry import RetryPolicy
from weight_transfer.transport.simnic.nic import SimNic
from weight_transfer.types import EngineRankMeta, ParamMeta


def one_replica_cluster(*, trainer_ranks: int, tp: int, fp8: bool = False) -> ClusterConfig:
    """One trainer node of ``trainer_ranks`` ranks (a NIC each) and one replica at ``tp``."""
    return cluster_from_dict({
        "name": f"{trainer_ranks}_to_tp{tp}",
        "trainer": {"nodes": 1, "gpus_per_node": trainer_ranks, "nics_per_node": trainer_ranks,
                    "nic_gbps": 8},
        "inference": {"replicas": 1, "gpus_per_replica": tp, "tensor_parallel": tp,
                      "expert_parallel": 1, "nodes_per_replica": 1, "nics_per_node": tp,
                      "nic_gbps": 8, "fp8": fp8},
    })


class SimnicEngines:
    """See the module docstring; ``engines`` are the metadata with the real regions."""

    def __init__(self, metas: Sequence[EngineRankMeta]) -> None:
        self.targets: dict[str, SimNic] = {}
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.engines: list[EngineRankMeta] = []
        for e in metas:
            fake = e.tensors[0].region
            buf = torch.zeros(fake.length, dtype=torch.uint8)
            target = self.targets.setdefault(fake.nic, SimNic(owner="engines", nic=fake.nic))
            real = target.register(buf)
            self.buffers[(e.replica, e.rank)] = buf
            self.engines.append(dataclasses.replace(e, tensors=tuple(
                dataclasses.replace(t, region=real) for t in e.tensors)))
        self.writer = SimNic(owner="trainers", nic="trainer-nic")
        for target in self.targets.values():
            self.writer.connect(target.peer_info("trainers"))

    def run(self, plan: Any, params: Sequence[ParamMeta], rank: int,
            get_param: Callable[[str], Any]) -> Any:
        """Trainer ``rank``'s tasks of ``plan`` written from ``get_param`` (no checksums,
        no retries); its TransferReport."""
        transfer = RankTransfer(plan=plan.trainer_plan(rank), params=params,
                                get_param=get_param, transport=self.writer,
                                integrity=IntegrityPolicy(mode="off"),
                                retry=RetryPolicy(attempts=1))
        try:
            return asyncio.run(transfer.run(version=1))
        finally:
            transfer.close()

    def mismatches(self, cfg: Any, state: Mapping[str, torch.Tensor], *, fp8: bool
                   ) -> list[tuple[str, int, str]]:
        """(replica, rank, tensor) of every engine tensor whose bytes differ from the
        reference loader's layout of ``state``."""
        bad = []
        for e in self.engines:
            want = load_engine_shard(cfg, state, e.shard, fp8=fp8)
            buf = self.buffers[(e.replica, e.rank)]
            bad += [(e.replica, e.rank, t.name) for t in e.tensors if not torch.equal(
                buf[t.offset : t.offset + t.nbytes], as_bytes(want[t.name]).reshape(-1))]
        return bad

    def close(self) -> None:
        self.writer.close()
        for target in self.targets.values():
            target.close()

    def __enter__(self) -> SimnicEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
