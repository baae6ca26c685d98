"""Run configs (``configs/runs/*.yaml``): what one launch of the demo job or the RL loop does.

A run config names a model config and a cluster config, the engines' dtype, how
many train-step + update cycles to run, how to train between updates, how to
verify each update, which Ray cluster to use, and the controller's settings
(``transfer:``, the library's own :class:`actors.config.TransferSettings`: every
field of the controller's config but the model and cluster, with the same names
and defaults; ``transfer.transport`` is ``simnic``, ``mooncake`` or ``rdma`` and
``transfer.transport_options`` its options). It is validated at the
boundary: :func:`load_run_config` turns every problem into a ``ValueError``
that names the file and the field (``train.lr``, ``model``, ...)::

    run = load_run_config("configs/runs/demo.yaml")
    run = run.with_overrides(fp8=True, updates=2)   # command-line options win
    run.model_path, run.cluster_path                # resolved, existing files

Relative paths are taken from the current directory when the file is there,
else from the repository root, so the same config works from a clone and
inside a ``ray job submit --working-dir .`` package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from actors.config import DemoActorConfig, TransferSettings
from actors.engine_registry import DEFAULT_ENGINE, engine_spec
from actors.tools.demo.trainers import DEFAULT_TRAINER, check_trainer
from configs import BASE_DIR
from weight_transfer.config_files import StrictModel, read_yaml, validate_mapping

ROOT = BASE_DIR


def resolve_path(path: str | Path, *, base: Path = ROOT) -> Path:
    """``path`` as given if absolute or present from the current directory, else under ``base``."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return base / p


class TrainConfig(StrictModel):
    """One optimizer step on the trainers before each update (next-token loss on random tokens)."""

    lr: PositiveFloat = DemoActorConfig().lr
    batch_size: PositiveInt = 4
    seq_len: PositiveInt = 32


class VerifyConfig(StrictModel):
    """How each update is checked.

    bf16 engines: every engine byte equals the reference layout of the trainer's
    weights, and greedy generations equal the trainer model's token for token.
    FP8 engines: every engine byte equals the reference FP8 quantization, and the
    engines' logits are within ``fp8_logits_rel_tol`` of the trainer model's
    (``max |engine - trainer| / max |trainer|`` over all positions and tokens).
    """

    prompts: PositiveInt = 4
    prompt_len: PositiveInt = 8
    max_new_tokens: PositiveInt = 8
    fp8_logits_rel_tol: PositiveFloat = 0.1


class RayConfig(StrictModel):
    """Which Ray cluster: ``address`` (e.g. ``auto``) joins one; ``null`` joins
    ``RAY_ADDRESS`` when it is set and otherwise starts a local instance of ``num_cpus``."""

    address: str | None = None
    num_cpus: PositiveInt = 8


# Run-file names of earlier versions -> the field that replaced each (an error names it).
RENAMED_TRANSFER = {
    "timeout_s": "setup_timeout_s and update_timeout_s",
    "simnic": "transport_options (the options of the chosen transport)",
    "mooncake": "transport_options (the options of the chosen transport)",
    "rdma": "transport_options (the options of the chosen transport)",
}


class RlConfig(StrictModel):
    """The RL loop example (scripts/rl_loop.py): REINFORCE towards a band of target tokens.

    The reward of a rollout is the fraction of its tokens in
    ``[target_start, target_end)``; rollouts are sampled at ``temperature`` from
    the engines' logits, or greedy when ``temperature`` is 0.
    """

    iterations: PositiveInt = 3
    prompts: PositiveInt = 8
    prompt_len: PositiveInt = 4
    rollout_tokens: PositiveInt = 8
    target_start: int = Field(default=0, ge=0)
    target_end: PositiveInt = 100
    temperature: float = Field(default=1.0, ge=0.0)
    lr: PositiveFloat = 1e-3
    # Rollouts whose oldest token came from weights more than max_lag versions behind the
    # trainers' are dropped before the policy step (None: keep every rollout).
    max_lag: int | None = Field(default=None, ge=0)
    # Sample the next iteration's rollouts while the policy step and the weight update run
    # (asynchronous RL): rollouts then straddle versions, and max_lag decides which count.
    overlap: bool = False

    @model_validator(mode="after")
    def _band(self) -> RlConfig:
        if self.target_end <= self.target_start:
            raise ValueError(f"target_end ({self.target_end}) must be greater than "
                             f"target_start ({self.target_start})")
        return self


class RunConfig(StrictModel):
    """One launch: the model, the cluster, the engines' dtype and what to run."""

    name: str = "run"
    model: Path
    cluster: Path = Path("configs/clusters/local_cpu.yaml")
    fp8: bool = False
    # The inference engine, a name of the engine registry: our reference decoder, a real
    # vLLM (the `vllm` extra), or one registered by the user.
    engine: str = DEFAULT_ENGINE
    # The trainer actors, a name of actors.tools.demo.trainers: FSDP2 (the ready-made
    # TrainerActor) or DeepSpeed ZeRO-3 (OpenRLHF's trainer).
    trainer: str = DEFAULT_TRAINER
    updates: int = Field(default=3, ge=1, le=1000)
    seed: int = 0
    train: TrainConfig = TrainConfig()
    verify: VerifyConfig = VerifyConfig()
    ray: RayConfig = RayConfig()
    transfer: TransferSettings = TransferSettings()
    rl: RlConfig = RlConfig()
    json_path: Path | None = Field(default=None, alias="json")

    @field_validator("transfer", mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        old = sorted(set(value) & set(RENAMED_TRANSFER)) if isinstance(value, dict) else []
        if old:
            raise ValueError("; ".join(f"transfer.{k} was renamed: use transfer."
                                       f"{RENAMED_TRANSFER[k]}" for k in old))
        return value

    @property
    def demo_actors(self) -> DemoActorConfig:
        """The ready-made actors' settings: ``seed`` and ``train.lr``."""
        return DemoActorConfig(seed=self.seed, lr=self.train.lr)

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str) -> str:
        return engine_spec(value).name  # ValueError listing the registered engines

    @field_validator("trainer")
    @classmethod
    def _trainer(cls, value: str) -> str:
        return check_trainer(value)  # ValueError listing the registered trainers

    @property
    def model_path(self) -> Path:
        return resolve_path(self.model)

    @property
    def cluster_path(self) -> Path:
        return resolve_path(self.cluster)

    def check_files(self, source: str) -> RunConfig:
        """ValueError naming ``source`` and the field when a referenced config file is missing."""
        for field, path in (("model", self.model_path), ("cluster", self.cluster_path)):
            if not path.is_file():
                raise ValueError(f"{source}: field {field}: no such file {path}")
        return self

    def with_overrides(self, **changes: Any) -> RunConfig:
        """A copy with the non-None ``changes`` applied and validated (CLI options win);
        ``transport`` sets ``transfer.transport`` (another transport than the file's takes
        its own default options)."""
        data = self.model_dump(by_alias=True)
        for key, value in changes.items():
            if value is None:
                continue
            if key == "transport":  # another transport: its own options, at their defaults
                if value != data["transfer"]["transport"]:
                    data["transfer"]["transport_options"] = None
                data["transfer"]["transport"] = value
            else:
                data["json" if key == "json_path" else key] = value
        return parse_run_config(data, source="<command line>")


def parse_run_config(data: Any, *, source: str) -> RunConfig:
    """Validate a mapping; ValueError names ``source`` and each bad field."""
    return validate_mapping(RunConfig, data, kind="run", source=source).check_files(source)


def load_run_config(path: str | Path) -> RunConfig:
    """Read and validate a ``configs/runs/*.yaml``; ValueError names the file and the field."""
    path = resolve_path(path)
    return parse_run_config(read_yaml(path, kind="run"), source=str(path))
