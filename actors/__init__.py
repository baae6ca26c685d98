"""Ray actors around the weight-transfer library: thin shells over scheduling/ and
weight_transfer/ (neither of which imports Ray).

::

    from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
    cfg = TransferConfig.from_files("configs/models/tiny_llama.yaml",
                                    "configs/clusters/local_cpu.yaml")
    ctl = WeightTransferController(trainers=launch_trainers(cfg), engines=launch_engines(cfg),
                                   config=cfg)
    ctl.setup()
    report = ctl.update(version=1)

Modules: trainer (TrainerMixin, TrainerActor), inference (InferenceMixin,
InferenceActor), schedule_actor (ScheduleActor), controller
(WeightTransferController), launch (placement and group formation), reports
(UpdateReport), config (TransferConfig).
"""

from actors.config import TransferConfig
from actors.controller import UpdateError, WeightTransferController
from actors.inference import InferenceActor, InferenceMixin, InferenceWorker
from actors.launch import launch_engines, launch_trainers
from actors.messages import PlanSummary, TrainerRankMeta
from actors.reports import RankReport, UpdateReport, WriteFailure
from actors.schedule_actor import ScheduleActor, Scheduler
from actors.trainer import TrainerActor, TrainerMixin, TrainerWorker

__all__ = [
    "InferenceActor",
    "InferenceMixin",
    "InferenceWorker",
    "PlanSummary",
    "RankReport",
    "ScheduleActor",
    "Scheduler",
    "TrainerActor",
    "TrainerMixin",
    "TrainerRankMeta",
    "TrainerWorker",
    "TransferConfig",
    "UpdateError",
    "UpdateReport",
    "WeightTransferController",
    "WriteFailure",
    "launch_engines",
    "launch_trainers",
]
