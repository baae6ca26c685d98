"""``wt demo --engine vllm``: the demo's trainers, controller and cycles, real vLLM engines.

Everything but the engines is :mod:`actors.tools.demo.fleet`'s. The engines are
:func:`actors.vllm.engine.launch_vllm_engines` replicas: one unmodified vLLM
``LLM`` per replica, owned by a Ray actor, our weight-transfer backend in every
worker, the controller driving one facade per TP rank. Each engine starts
from a checkpoint the trainers save of their initial weights, in float32: the
trainers' weights are bf16 values, which float32 holds exactly, so vLLM's
greedy generations are compared with the trainers' model token for token (in
bf16, vLLM's CPU kernels and transformers' accumulate in different orders and
may break near-ties differently). After each update:

* bytes (``"oracle": "vllm.load_weights"``): the trainers save their current
  weights as a checkpoint; in every vLLM worker, vLLM's own ``load_weights`` of
  it (:func:`actors.tools.testkit.vllm_oracle.oracle_check`, independent of our recorded
  plan) must equal every byte our backend registered; only differences and
  digests leave the worker;
* generations and versions: as with the reference engine.

The byte check is :func:`oracle_bytes`, handed the oracle that reaches the
workers: here the worker-side check travels as a callable through ``collective_rpc``, which
vLLM allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: set for the
demo's own engine processes (``wt demo --engine vllm-server`` reaches a test
worker extension by name instead). vLLM's own logs stay at WARNING and above
(``VLLM_LOGGING_LEVEL``, read when a process imports vLLM: this one and the
engines'); ``wt demo --verbose`` shows its INFO lines, and a
``VLLM_LOGGING_LEVEL`` set in the environment wins over both. FP8 engines with vLLM need a GPU
(``tests/integration/test_vllm_fp8_layout.py``); the demo refuses them on CPU.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from rich.progress import Progress

from actors.tools.demo.checks import capped
from actors.tools.demo.fleet import Fleet, trainer_class, transfer_config
from actors.tools.demo.run_config import RunConfig
from actors.tools.demo.verify import check_changed
from actors.vllm.engine import launch_vllm_engines, save_trainer_checkpoint
from weight_transfer.types import EngineRankId

ORACLE = "vllm.load_weights"
ENGINE_ENV = {
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the oracle runs as a callable
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # Ray forwards actors' stdout to ours (--json -)
}
LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
QUIET_LEVEL = "WARNING"  # vLLM's INFO lines outnumber the demo's own about ten to one
VERBOSE_LEVEL = "INFO"


def vllm_log_level(verbose: bool = False) -> str:
    """vLLM's log level for the demo: ``VLLM_LOGGING_LEVEL`` where set, else WARNING
    (INFO with ``verbose``)."""
    return os.environ.get(LOG_LEVEL_ENV) or (VERBOSE_LEVEL if verbose else QUIET_LEVEL)


def engine_env(level: str) -> dict[str, str]:
    """The environment of the engines' processes, vLLM logging at ``level``."""
    return {**ENGINE_ENV, LOG_LEVEL_ENV: level}


def set_vllm_log_level(level: str) -> None:
    """vLLM logs at ``level`` in this process: before vLLM is imported (it reads the
    variable then) and after (its logger)."""
    os.environ[LOG_LEVEL_ENV] = level
    logging.getLogger("vllm").setLevel(level)


def start_fleet(run: RunConfig, progress: Progress | None = None, **overrides: Any) -> Fleet:
    """Trainers, one vLLM engine per replica (from the trainers' initial weights) and the
    controller after ``setup()``; vLLM logs at :func:`vllm_log_level` (``overrides``:
    TransferConfig fields, see :func:`actors.tools.demo.fleet.transfer_config`)."""
    from actors import WeightTransferController, launch_trainers
    from actors.tools.cli.progress import PhaseBars
    from actors.tools.testkit.vllm_oracle import vllm_missing

    level = vllm_log_level()
    set_vllm_log_level(level)  # before vllm_missing() imports vLLM here
    if (why := vllm_missing()) is not None:
        raise RuntimeError(f"--engine vllm: {why} (install the `vllm` extra)")
    config = transfer_config(run, **overrides)
    if config.engine_fp8:
        _require_cuda("FP8 engines with vLLM")
    start = time.perf_counter()
    bars = PhaseBars(progress) if progress is not None else (lambda *_: None)
    workdir = Path(tempfile.mkdtemp(prefix="wt-demo-vllm-"))
    handles = []
    try:
        bars("start trainer ranks", 0, 1)
        trainers = launch_trainers(config, demo=run.demo_actors,
                                   **({"actor_cls": cls} if (cls := trainer_class(run)) else {}))
        handles.append(trainers)
        bars("start trainer ranks", 1, 1)
        bars("start vLLM engines", 0, 1)
        replicas = launch_replicas(config, trainers, workdir, env=engine_env(level))
        handles.append(replicas)
        bars("start vLLM engines", 1, 1)
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=config)
        ctl.progress = bars if progress is not None else None
        ctl.setup()
    except BaseException:
        for h in reversed(handles):
            h.close()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    ctl.progress = None
    names = [config.cluster.replica_name(i) for i in range(len(replicas))]
    return Fleet(run=run, config=config, trainers=list(trainers),
                 replicas=dict(zip(names, replicas, strict=True)), controller=ctl,
                 setup_seconds=time.perf_counter() - start, engine="vllm",
                 owners=list(replicas.owners), workdir=workdir, handles=handles)


def launch_replicas(config: Any, trainers: Any, workdir: Path,
                    env: dict[str, str] | None = None) -> Any:
    """vLLM engines started from the trainers' current weights (saved under ``workdir``):
    the launch handle of :func:`actors.vllm.engine.launch_vllm_engines` (``env``: the
    engines' environment, default :data:`ENGINE_ENV`)."""
    first = save_trainer_checkpoint(list(trainers), workdir / "v0")
    return launch_vllm_engines(config, str(first), dtype="float32",
                               env=ENGINE_ENV if env is None else env)


def sample_rollouts(replica: list, prompts: list[list[int]], rl: Any, gen: Any) -> list:
    """``rl.rollout_tokens`` new tokens per prompt: a vLLM replica samples itself, once
    (seeded from ``gen``); each a :class:`weight_transfer.sync.versions.Generation` with vLLM's
    own version spans."""
    import torch

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    return ray.get(replica[0].generate_tagged.remote(prompts, rl.rollout_tokens,
                                                     rl.temperature, seed))


def _require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{what} need a CUDA GPU (vLLM's block FP8 does not run on this "
                         "CPU); run without --fp8")


# One replica's oracle: (its Ray owner, a checkpoint path) -> per TP rank
# (differences from vLLM's own load_weights, sha256 of each registered tensor).
Oracle = Callable[[Any, str], list[tuple[list[str], dict[str, str]]]]


def oracle_bytes(fleet: Fleet, checks: dict, problems: list[str], previous: dict | None,
                 *, oracle: Oracle) -> dict[str, dict[str, str]]:
    """Every registered byte against vLLM's own load_weights of the trainers' current
    weights, saved as a checkpoint and checked in each replica's workers by ``oracle``;
    returns the digests per engine rank (``checks``/``problems`` get the verdicts)."""
    path = save_trainer_checkpoint(fleet.trainers,
                                   Path(tempfile.mkdtemp(dir=fleet.workdir)) / "current")
    got: dict[str, dict[str, str]] = {}
    issues: list[str] = []
    try:
        for name, owner in zip(fleet.replicas, fleet.owners, strict=True):
            for rank, (differences, digests) in enumerate(oracle(owner, str(path))):
                who = str(EngineRankId(replica=name, rank=rank))
                issues += [f"{who}: {d}" for d in differences]
                got[who] = digests
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    checks.update(bytes=not issues, tensors=sum(len(d) for d in got.values()), oracle=ORACLE)
    problems += capped(issues)
    check_changed(got, previous, checks, problems)
    return got


def _callable_oracle(owner: Any, checkpoint: str) -> list[tuple[list[str], dict[str, str]]]:
    """The check sent to the workers as a callable through ``collective_rpc``."""
    from actors.tools.testkit.vllm_oracle import oracle_check

    return ray.get(owner.collective_rpc.remote(oracle_check, (checkpoint,)))


def check_bytes(fleet: Fleet, checks: dict, problems: list[str],
                previous: dict | None) -> dict[str, dict[str, str]]:
    """Every registered byte against vLLM's own load_weights of the trainers' weights."""
    return oracle_bytes(fleet, checks, problems, previous, oracle=_callable_oracle)
