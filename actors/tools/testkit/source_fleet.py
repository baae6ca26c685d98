"""A fleet for trainer-source tests: trainers on one gloo group, reference engines at TP 1 and 2.

The DeepSpeed and Megatron tests attach a real framework's model in each trainer actor
and check the bytes of a TP=1 and a TP=2 reference replica of one model file, each
with its own controller over the same trainers::

    with reference_engines(model_file) as (configs, engines):   # keyed by TP: 1 and 2
        trainers = start_trainers(cls, [(r, 2, free_port()) for r in range(2)], env={...})
        ...
        kill(trainers)

:func:`fp8_update` adds one FP8 replica over the same trainers for one update;
:func:`spawned_ranks` runs gloo ranks as plain spawned processes where no Ray actor is
needed (cheaper).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
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


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set for the processes started inside (spawn copies it), restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def spawned_ranks(target: Any, world: int, *args: Any, env: Mapping[str, str] | None = None,
                  what: str = "rank", timeout_s: float = 300) -> Iterator[list[Any]]:
    """``world`` spawned processes, each running ``target(rank, world, port, *args, conn)``
    (``port``: a loopback store they can join; ``conn``: a pipe end for one answer); yields
    the answers in rank order. An exception a rank sends back is raised here; a rank still
    alive 30 s after the block is killed."""
    from weight_transfer.sync.listen import serve_store

    ctx = mp.get_context("spawn")
    store = serve_store("127.0.0.1", timeout_s=120)
    pipes, procs = [], []
    try:
        with _environment(env or {}):
            for r in range(world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=target, args=(r, world, store.port, *args, child),
                                daemon=True)
                p.start()
                pipes.append(parent)
                procs.append(p)
        out = []
        for r, pipe in enumerate(pipes):
            if not pipe.poll(timeout_s):
                raise TimeoutError(f"{what} {r} did not answer in {timeout_s:.0f} s")
            got = pipe.recv()
            if isinstance(got, BaseException):
                raise got
            out.append(got)
        yield out
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
