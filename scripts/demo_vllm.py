"""``wt demo --engine vllm``: the demo's trainers, controller and cycles, real vLLM engines.

Everything but the engines is :mod:`scripts.demo`'s. The engines are
:func:`actors.vllm_engine.launch_vllm_engines` replicas: one unmodified vLLM
``LLM`` per replica, owned by a Ray actor, our weight-transfer backend in every
worker, the controller driving one facade per TP rank. Each engine starts
from a checkpoint the trainers save of their initial weights, in float32: the
trainers' weights are bf16 values, which float32 holds exactly, so vLLM's
greedy generations are compared with the trainers' model token for token (in
bf16, vLLM's CPU kernels and transformers' accumulate in different orders and
may break near-ties differently). After each update:

* bytes (``"oracle": "vllm.load_weights"``): the trainers save their current
  weights as a checkpoint; in every vLLM worker, vLLM's own ``load_weights`` of
  it (:func:`testkit.vllm_oracle.oracle_check`, independent of our recorded
  plan) must equal every byte our backend registered; only differences and
  digests leave the worker;
* generations and versions: as with the reference engine.

The worker-side check travels as a callable through ``collective_rpc``, which
vLLM allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: set for the
demo's own engine processes. FP8 engines with vLLM need a GPU
(``tests/integration/test_vllm_fp8.py``); the demo refuses them on CPU.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from rich.progress import Progress

from scripts.demo import Fleet, transfer_config
from scripts.demo_checks import capped
from scripts.demo_verify import check_changed
from scripts.run_config import RunConfig

ORACLE = "vllm.load_weights"
ENGINE_ENV = {
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the oracle runs as a callable
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # Ray forwards actors' stdout to ours (--json -)
}


def _save_checkpoint(trainer: Any, path: str) -> bool:
    """In every trainer rank (a collective): rank 0 saves the current weights, HF format."""
    model = trainer._reference_model()
    if model is None:
        return False
    model.save_pretrained(path)
    return True


def save_trainer_checkpoint(trainers: list[Any], path: Path) -> Path:
    """The trainers' current weights as a Hugging Face checkpoint at ``path``."""
    saved = ray.get([t.__ray_call__.remote(_save_checkpoint, str(path)) for t in trainers])
    if sum(saved) != 1:
        raise RuntimeError(f"{sum(saved)} trainer ranks saved a checkpoint, expected 1")
    return path


def start_fleet(run: RunConfig, progress: Progress | None = None) -> Fleet:
    """Trainers, one vLLM engine per replica (from the trainers' initial weights) and the
    controller after ``setup()``."""
    from actors import WeightTransferController, launch_trainers
    from scripts.progress import PhaseBars
    from testkit.vllm_oracle import vllm_missing

    if (why := vllm_missing()) is not None:
        raise RuntimeError(f"--engine vllm: {why} (install the `vllm` extra)")
    config = transfer_config(run)
    if config.engine_fp8:
        _require_cuda("FP8 engines with vLLM")
    start = time.perf_counter()
    bars = PhaseBars(progress) if progress is not None else (lambda *_: None)
    workdir = Path(tempfile.mkdtemp(prefix="wt-demo-vllm-"))
    handles = []
    try:
        bars("start trainer ranks", 0, 1)
        trainers = launch_trainers(config)
        handles.append(trainers)
        bars("start trainer ranks", 1, 1)
        bars("start vLLM engines", 0, 1)
        replicas = launch_replicas(config, trainers, workdir)
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


def launch_replicas(config: Any, trainers: Any, workdir: Path) -> Any:
    """vLLM engines started from the trainers' current weights (saved under ``workdir``):
    the launch handle of :func:`actors.vllm_engine.launch_vllm_engines`."""
    from weight_transfer.engines.registry import engine_spec

    first = save_trainer_checkpoint(list(trainers), workdir / "v0")
    launch = engine_spec("vllm").launcher()
    return launch(config, str(first), dtype="float32", env=ENGINE_ENV)


def sample_rollouts(replica: list, prompts: list[list[int]], rl: Any,
                    gen: Any) -> list[list[int]]:
    """``rl.rollout_tokens`` new tokens per prompt: a vLLM replica samples itself, once
    (seeded from ``gen``)."""
    import torch

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    return ray.get(replica[0].generate.remote(prompts, rl.rollout_tokens, rl.temperature, seed))


def _require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{what} need a CUDA GPU (vLLM's block FP8 does not run on this "
                         "CPU); run without --fp8")


def check_bytes(fleet: Fleet, checks: dict, problems: list[str],
                previous: dict | None) -> dict[str, dict[str, str]]:
    """Every registered byte against vLLM's own load_weights of the trainers' weights."""
    from testkit.vllm_oracle import oracle_check

    path = save_trainer_checkpoint(fleet.trainers,
                                   Path(tempfile.mkdtemp(dir=fleet.workdir)) / "current")
    got: dict[str, dict[str, str]] = {}
    issues: list[str] = []
    try:
        for name, owner in zip(fleet.replicas, fleet.owners, strict=True):
            ranks = ray.get(owner.collective_rpc.remote(oracle_check, (str(path),)))
            for rank, (differences, digests) in enumerate(ranks):
                issues += [f"{name}/tp{rank}: {d}" for d in differences]
                got[f"{name}/tp{rank}"] = digests
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    checks.update(bytes=not issues, tensors=sum(len(d) for d in got.values()), oracle=ORACLE)
    problems += capped(issues)
    check_changed(got, previous, checks, problems)
    return got
