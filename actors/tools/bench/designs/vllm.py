"""``wt bench designs --engine vllm``: the same designs, caps and checks against real vLLM.

The fleet is the vLLM demo's (:func:`actors.tools.demo.vllm_demo.start_fleet`: FSDP2
trainer ranks, one unmodified vLLM ``LLM`` per replica owned by a Ray actor,
our weight-transfer backend in every worker, the controller set up over
simnic); the default run config is ``configs/runs/bench_vllm.yaml`` (2 trainer
ranks -> 1 replica x TP2, one simulated NIC per rank, as the baselines are
paced). :class:`VllmBench` gives :class:`actors.tools.bench.designs.fleet.DesignBench`
its engine side:

* ``p2p`` (ours): ``controller.update(v)`` as in the vLLM demo: the engine is
  paused, the trainers write one-sided into the memory our backend registered
  (the parameters vLLM computes with, and a loading-format arena for the layers
  vLLM repacks on CPU), ``finish_weight_update`` reprocesses the arena;
* ``rank0``, ``bucketed``, ``rpc``: the trainer side of :mod:`actors.tools.bench.baselines`,
  the engine side inside vLLM's workers (:mod:`actors.tools.bench.baselines_vllm`): vLLM's
  own ``model.load_weights`` of every received tensor into that same memory,
  inside vLLM's update session, closed by the same reprocess step;
* before every update every registered engine byte is zeroed
  (:func:`actors.tools.bench.baselines_vllm.worker_zero`); after each design's last update
  every registered byte must equal vLLM's own ``load_weights`` of a checkpoint
  of the trainers' weights (:func:`actors.tools.testkit.vllm_oracle.oracle_check`, the vLLM
  demo's byte check), else the design is reported failed.

Pacing is the reference bench's: a :class:`~actors.tools.bench.pacing.NicPacer`
in trainer rank 0 and in every vLLM worker (one NIC per engine rank, as the
plan of ours has), gloo's broadcast tree counted::

    wt bench designs --engine vllm --updates 3 --json designs_vllm.json --png designs_vllm.png
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import actors.tools.bench.baselines as B
import actors.tools.bench.baselines_vllm as V
from actors.tools.bench.designs.fleet import RANK0_DESIGNS, DesignBench
from weight_transfer.types import EngineRankId


class VllmBench(DesignBench):
    """The baselines' engine side in vLLM's workers; see the module docstring."""

    engine = "vllm"

    def __init__(self, fleet: Any, bucket_bytes: int, timeout_s: float) -> None:
        self.owners = list(fleet.owners)
        self.tp = fleet.config.cluster.inference.gpus_per_replica
        self._checkpoint: Path | None = None
        self._sessions = 0  # baseline updates (versions of their own, apart from ours)
        super().__init__(fleet, bucket_bytes, timeout_s)

    def _each_worker(self, fn: Any, *args: Any) -> list[Any]:
        """``fn(worker, *args)`` in every worker of every replica; one list per replica."""
        return self._get([o.collective_rpc.remote(fn, args) for o in self.owners])

    def _flat(self, fn: Any, *args: Any) -> list[Any]:
        return [r for ranks in self._each_worker(fn, *args) for r in ranks]

    def prepare_engines(self, expert_naming: str) -> None:
        """Save, once, the checkpoint every check loads (the trainers' weights do not change
        during the bench)."""
        from actors.vllm.engine import save_trainer_checkpoint

        root = Path(tempfile.mkdtemp(dir=self.fleet.workdir, prefix="bench-"))
        self._checkpoint = save_trainer_checkpoint(self.trainers, root / "current")

    def join_engines(self, host: str, port: int, size: int) -> list[Any]:
        return [o.collective_rpc.remote(V.worker_join, (host, port, 1 + i * self.tp, size))
                for i, o in enumerate(self.owners)]

    def engine_cap_refs(self, gbps: float | None) -> list[Any]:
        return [o.collective_rpc.remote(V.worker_set_cap, (gbps,)) for o in self.owners]

    def engine_nic_bytes(self) -> list[dict[str, int]]:
        return self._flat(V.worker_nic_bytes)

    def zero_engines(self) -> None:
        self._flat(V.worker_zero)

    def engine_refs(self, design: str) -> list[Any]:
        if design in RANK0_DESIGNS:
            args: tuple = (V.worker_rank0, ([p[:3] for p in self.params],))
        else:
            args = (V.worker_bucketed, (V.plain_buckets(self.buckets),))
        return [o.collective_rpc.remote(*args) for o in self.owners]

    def rpc_refs(self) -> list[Any]:
        return [t.__ray_call__.remote(B.trainer_rpc, self.owners, self.timeout_s,
                                      V.owner_update_weight) for t in self.trainers]

    def baseline_update(self, design: str) -> None:
        """vLLM's update session around the design: open, load, close (reprocess)."""
        self._sessions += 1
        self._get([o.__ray_call__.remote(V.owner_begin) for o in self.owners])
        try:
            self._get(self.refs(design))
        finally:
            self._get([o.__ray_call__.remote(V.owner_finish, f"{design}-{self._sessions}")
                       for o in self.owners])

    def verify(self) -> list[str]:
        from actors.tools.testkit.vllm_oracle import oracle_check

        problems: list[str] = []
        for name, ranks in zip(self.fleet.replicas, self._each_worker(
                oracle_check, str(self._checkpoint)), strict=True):
            for rank, (differences, _digests) in enumerate(ranks):
                problems += [f"{EngineRankId(replica=name, rank=rank)}: {d}" for d in differences]
        return problems

    def close(self) -> None:
        if self._checkpoint is not None:
            shutil.rmtree(self._checkpoint.parent, ignore_errors=True)
