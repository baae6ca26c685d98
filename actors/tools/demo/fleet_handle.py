"""The running demo job as one object: :class:`Fleet` (actors, controller, what the checks need).

:mod:`actors.tools.demo.fleet` starts a fleet (``start_fleet``, ``fleet_session``), the
vLLM demo (:mod:`actors.tools.demo.vllm_demo`) starts its own, and the checks of
:mod:`actors.tools.demo.verify`, ``wt chaos`` and ``wt soak`` take one. It lives in
its own module so that those modules and :mod:`actors.tools.demo.fleet` import it without
importing each other (no import cycle, not even for type checking).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.engine_registry import engine_spec
from actors.tools.demo.run_config import RunConfig
from actors.tools.demo.trainers import DEFAULT_TRAINER
from weight_transfer.types import EngineRankId

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Fleet:
    """The running job: actors, the controller and what the checks need to know.

    ``handles``: the launch handles (:class:`actors.ready.handles.Launched`) of every actor the
    job started; :meth:`close` closes them (actors, engine processes, placement groups).
    """

    run: RunConfig
    config: Any  # actors.TransferConfig
    trainers: list[Any]
    replicas: dict[str, list[Any]]
    controller: Any
    setup_seconds: float
    engine: str = "reference"
    owners: list[Any] = field(default_factory=list)  # actors owning the engines (vLLM)
    workdir: Path | None = None  # checkpoints of the trainers' weights (vLLM), removed at close
    handles: list[Any] = field(default_factory=list)

    def adopt(self, handle: Any) -> Any:
        """Own ``handle`` (closed with the fleet); returns it."""
        self.handles.append(handle)
        return handle

    @property
    def engine_keys(self) -> dict[str, Any]:
        """``{"<replica>/tp<rank>": ShardSpec}`` of every engine rank."""
        cluster = self.config.cluster
        return {str(EngineRankId(replica=name, rank=local)): cluster.engine_rank(i, local)[2]
                for i, (name, actors) in enumerate(self.replicas.items())
                for local in range(len(actors))}

    def describe(self) -> str:
        cfg, summary = self.config, self.controller.summary
        return (f"[bold]{self.run.name}[/]: {cfg.model.name}, {len(self.trainers)} "
                f"{'' if self.run.trainer == DEFAULT_TRAINER else self.run.trainer + ' '}"
                "trainer ranks"
                f" -> {len(self.replicas)} replicas x TP{cfg.cluster.inference.gpus_per_replica}"
                f" over {cfg.transport_spec.describe()}"
                f" ({self.engine_kind} engines); plan: {summary.num_tasks} "
                f"writes, {summary.bytes_total / 1e6:.2f} MB, {summary.num_groups} mesh group(s);"
                f" set up in {self.setup_seconds:.1f} s")

    @property
    def engine_kind(self) -> str:
        dtype = "fp8" if self.config.engine_fp8 else "bf16"
        return engine_spec(self.engine).kind or dtype

    def info(self) -> dict[str, Any]:
        cfg, summary = self.config, self.controller.summary
        return {"run": self.run.name, "engine": self.engine, "model": cfg.model.name,
                "cluster": cfg.cluster.name, "fp8": cfg.engine_fp8,
                "setup_seconds": self.setup_seconds,
                "plan": {"bytes": summary.bytes_total, "tasks": summary.num_tasks,
                         "mesh_groups": summary.num_groups},
                # a trainer other than the default (fsdp2) is named; the default's JSON
                # stays as it was
                **({"trainer": self.run.trainer} if self.run.trainer != DEFAULT_TRAINER
                   else {})}

    def close(self) -> None:
        """Drop the controller, then every launch handle: the engines' own processes, the
        actors and their placement groups."""
        self.controller.shutdown()
        for handle in reversed(self.handles):
            handle.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
