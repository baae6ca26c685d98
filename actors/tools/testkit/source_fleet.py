"""A fleet for trainer-source tests: trainers on one gloo group, reference engines at TP 1 and 2.

The DeepSpeed and Megatron tests attach a real framework's model in each trainer actor
and check the bytes of a TP=1 and a TP=2 reference replica of one model file, each
with its own controller over the same trainers::

    with reference_engines(model_file) as (configs, engines):   # keyed by TP: 1 and 2
        trainers = start_trainers(cls, [(r, 2, free_port()) for r in range(2)], env={...})
        ...
        kill(trainers)

:func:`fp8_update` adds one FP8 replica over the same trainers for one update.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from actors import TransferConfig, launch_engines
from configs import CONFIGS_DIR

# engine TP -> the cluster file of one reference replica at that TP (2 trainer ranks)
CLUSTERS = {1: "local_cpu_small.yaml", 2: "vllm_cpu.yaml"}


def free_port() -> int:
    """A TCP port free on loopback now (for a gloo group's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def reference_engines(model: str | Path, **options: Any
                      ) -> Iterator[tuple[dict[int, TransferConfig], dict[int, Any]]]:
    """A TransferConfig (``options``: its timeouts) and a launched reference replica per
    engine TP of :data:`CLUSTERS`; the replicas stop when the block ends."""
    configs = {tp: TransferConfig.from_files(model, CONFIGS_DIR / "clusters" / name, **options)
               for tp, name in CLUSTERS.items()}
    engines: dict[int, Any] = {}
    try:
        for tp, cfg in configs.items():
            engines[tp] = launch_engines(cfg)
        yield configs, engines
    finally:
        for handle in engines.values():
            handle.close()


@contextlib.contextmanager
def fp8_update(cfg: TransferConfig, trainers: Sequence[Any], version: int) -> Iterator[tuple]:
    """One FP8 replica of ``cfg`` (``fp8=True``) under a controller over ``trainers``: set
    up, one real ``train_step(version)`` on every rank, one update; yields (the setup's
    summary, the replica's actors) for the caller's checks; all closed after."""
    from actors import WeightTransferController

    cfg = cfg.replace(fp8=True)
    with launch_engines(cfg) as replicas:
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        try:
            summary = ctl.setup()
            ray.get([t.train_step.remote(version) for t in trainers])
            report = ctl.update(version=version)
            if report.bytes != summary.bytes_total:
                raise AssertionError(f"update {version} wrote {report.bytes} B, the plan "
                                     f"{summary.bytes_total}")
            yield summary, replicas
        finally:
            ctl.shutdown()


def start_trainers(cls: Any, args: Iterable[Sequence[Any]], *, env: Mapping[str, str]
                   ) -> list[Any]:
    """One actor of ``cls`` per argument tuple (0.1 CPU each, ``env`` set), started; a
    failed start raises here with its cause."""
    actors = [cls.options(num_cpus=0.1, runtime_env={"env_vars": dict(env)}).remote(*a)
              for a in args]
    ray.get([t.__ray_ready__.remote() for t in actors])
    return actors


def kill(actors: Iterable[Any]) -> None:
    for t in actors:
        ray.kill(t)
