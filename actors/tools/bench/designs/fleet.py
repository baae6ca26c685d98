"""The fleet side of ``wt bench designs``: one update of each design on the running actors.

:class:`DesignBench` holds what every engine shares: the trainer ranks (the
baselines' trainer side in :mod:`actors.tools.bench.baselines`), the bucket layout, the
gloo broadcast group of trainer rank 0 and every engine rank, the caps of
ours (simnic) and of the baselines (:class:`~actors.tools.bench.pacing.NicPacer`
per process) and the timed update. Each engine subclasses it with its engine
side, its zeroing and its byte check::

    bench = ReferenceBench(fleet, bucket_bytes=64 << 20, timeout_s=900)
    bench.set_caps(0.05)
    seconds = bench.update("rank0")    # zero every engine byte, one timed update
    problems = bench.verify()          # [] when every engine byte is as expected

The vLLM engine's subclass is :class:`actors.tools.bench.designs.vllm.VllmBench`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import ray

import actors.tools.bench.baselines as B
from actors.tools.bench.pacing import bucket_layout
from actors.tools.demo.checks import byte_problems
from actors.tools.demo.verify import _engine_digests, _trainer_digests
from weight_transfer.types import EngineRankId

# ours, each design the TransferConfig fields it sets: p2p (shard-direct pieces, no gather
# where the owner's shard covers a piece; zero-copy where the bytes already match),
# p2p_staged (the same with every piece copied into the staging arena first) and
# p2p_gather (every parameter gathered first: the mode before shard-direct pieces)
P2P_MODES = {"p2p": {"gather": "shard_direct", "source": "auto"},
             "p2p_staged": {"gather": "shard_direct", "source": "snapshot"},
             "p2p_gather": {"gather": "full", "source": "auto"}}


# the designs whose update is rank0's: native is OpenRLHF's (rank0 on DeepSpeed ZeRO-3
# trainers, each parameter gathered by deepspeed.zero.GatheredParameters)
RANK0_DESIGNS = ("rank0", "native")


def mode_of(config: Any) -> str:
    """The p2p design a transfer config runs (``p2p`` for a gather/source pair none has)."""
    pair = {"gather": config.gather, "source": config.source}
    return next((d for d, m in P2P_MODES.items() if m == pair), "p2p")


class DesignBench(ABC):
    """The running fleet and the baselines' set-up on it (engine-independent part)."""

    engine = "base"

    def __init__(self, fleet: Any, bucket_bytes: int, timeout_s: float) -> None:
        self.fleet, self.timeout_s = fleet, timeout_s
        self.trainers = fleet.trainers
        self.engines = [a for r in fleet.replicas.values() for a in r]
        info = ray.get(self.trainers[0].__ray_call__.remote(B.trainer_params))
        self.params = info["params"]
        self.buckets = bucket_layout(self.params, bucket_bytes)
        self.prepare_engines(info["expert_naming"])
        host, port = self._get(self.trainers[0].__ray_call__.remote(B.serve_group_store))
        size = 1 + len(self.engines)
        self._get([self.trainers[0].__ray_call__.remote(B.join_group, host, port, 0, size),
                   *self.join_engines(host, port, size)])
        self.version = 0
        self.last_report: Any = None
        # ours in each gather mode (P2P_MODES): the fleet's controller for its own mode, a
        # second one on the same actors for the other, set up again whenever it takes over
        self.controllers = {mode_of(fleet.config): fleet.controller}
        self.active = mode_of(fleet.config)

    def controller(self, design: str) -> Any:
        """The controller of p2p ``design``, set up (untimed) if another one ran last."""
        from actors import WeightTransferController

        if design not in self.controllers:
            self.controllers[design] = WeightTransferController(
                trainers=self.trainers, engines=list(self.fleet.replicas.values()),
                config=self.fleet.config.replace(**P2P_MODES[design]))
            self.active = None
        ctl = self.controllers[design]
        if self.active != design:
            ctl.setup()  # the trainers now replay this controller's plan
            self.active = design
        return ctl

    def _get(self, refs: Any) -> Any:
        return ray.get(refs, timeout=self.timeout_s)

    # ---------------------------------------------------------------- engine hooks

    @abstractmethod
    def prepare_engines(self, expert_naming: str) -> None:
        raise NotImplementedError

    @abstractmethod
    def join_engines(self, host: str, port: int, size: int) -> list[Any]:
        """Refs of every engine rank joining the broadcast group (ranks 1 ... size-1)."""
        raise NotImplementedError

    @abstractmethod
    def engine_cap_refs(self, gbps: float | None) -> list[Any]:
        raise NotImplementedError

    @abstractmethod
    def engine_nic_bytes(self) -> list[dict[str, int]]:
        raise NotImplementedError

    @abstractmethod
    def zero_engines(self) -> None:
        raise NotImplementedError

    @abstractmethod
    def engine_refs(self, design: str) -> list[Any]:
        """Start the engine side of one update of ``design`` (none for ``rpc``)."""
        raise NotImplementedError

    @abstractmethod
    def rpc_refs(self) -> list[Any]:
        raise NotImplementedError

    def baseline_update(self, design: str) -> None:
        """One update of a baseline design, waited for."""
        self._get(self.refs(design))

    @abstractmethod
    def verify(self) -> list[str]:
        raise NotImplementedError

    # ---------------------------------------------------------------- shared

    def set_caps(self, gbps: float | None) -> None:
        self._get([a.__ray_call__.remote(B.set_cap, gbps) for a in self.trainers]
                  + [t.__ray_call__.remote(B.set_simnic_cap, gbps) for t in self.trainers]
                  + self.engine_cap_refs(gbps))

    def nic_bytes(self) -> list[dict[str, int]]:
        """Baseline NIC bytes of trainer rank 0, then of every engine rank."""
        return self._get([self.trainers[0].__ray_call__.remote(B.nic_bytes)]) \
            + self.engine_nic_bytes()

    def refs(self, design: str) -> list[Any]:
        """Start one update of ``design`` on every actor."""
        t = self.trainers
        if design in RANK0_DESIGNS:
            return [x.__ray_call__.remote(B.trainer_rank0) for x in t] + self.engine_refs(design)
        if design == "bucketed":
            return ([x.__ray_call__.remote(B.trainer_bucketed, self.buckets) for x in t]
                    + self.engine_refs(design))
        if design == "rpc":
            return self.rpc_refs()
        if design == "gather_only":
            return [x.__ray_call__.remote(B.trainer_gather_only) for x in t]
        raise ValueError(f"unknown design {design!r}")

    def update(self, design: str) -> float:
        """Zero every engine byte, then one timed update of ``design``; seconds."""
        ctl = self.controller(design) if design in P2P_MODES else None
        self.zero_engines()
        start = time.perf_counter()
        if ctl is not None:
            self.version += 1
            self.last_report = ctl.update(self.version)
        elif design == "gather_only":
            self._get(self.refs(design))
        else:
            self.baseline_update(design)
        return time.perf_counter() - start

    def close(self) -> None:  # noqa: B027 (a hook: nothing to release by default)
        """Release what the bench holds beyond the fleet (nothing by default)."""


class ReferenceBench(DesignBench):
    """Our reference engine: every engine rank is an actor running the baselines' engine
    side (:mod:`actors.tools.bench.baselines`), checked against the reference loader's layout."""

    engine = "reference"

    def prepare_engines(self, expert_naming: str) -> None:
        self._get([e.__ray_call__.remote(B.engine_prepare, expert_naming)
                   for e in self.engines])
        fleet = self.fleet
        self.want = next(d for d in self._get([
            t.__ray_call__.remote(_trainer_digests, fleet.engine_keys, fleet.config.engine_fp8)
            for t in self.trainers]) if d is not None)

    def join_engines(self, host: str, port: int, size: int) -> list[Any]:
        return [e.__ray_call__.remote(B.join_group, host, port, i + 1, size)
                for i, e in enumerate(self.engines)]

    def engine_cap_refs(self, gbps: float | None) -> list[Any]:
        return [e.__ray_call__.remote(B.set_cap, gbps) for e in self.engines]

    def engine_nic_bytes(self) -> list[dict[str, int]]:
        return self._get([e.__ray_call__.remote(B.nic_bytes) for e in self.engines])

    def zero_engines(self) -> None:
        self._get([e.__ray_call__.remote(B.engine_zero) for e in self.engines])

    def engine_refs(self, design: str) -> list[Any]:
        if design in RANK0_DESIGNS:
            plist = [p[:3] for p in self.params]
            return [x.__ray_call__.remote(B.engine_rank0, plist) for x in self.engines]
        return [x.__ray_call__.remote(B.engine_bucketed, self.buckets) for x in self.engines]

    def rpc_refs(self) -> list[Any]:
        return [x.__ray_call__.remote(B.trainer_rpc, self.engines, self.timeout_s)
                for x in self.trainers]

    def verify(self) -> list[str]:
        got = {str(EngineRankId(replica=name, rank=r)): d
               for name, actors in self.fleet.replicas.items()
               for r, d in enumerate(self._get([a.__ray_call__.remote(_engine_digests)
                                                for a in actors]))}
        return byte_problems(self.want, got)
