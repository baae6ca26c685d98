"""``wt demo --engine vllm-server``: the demo's trainers and cycles, vLLM served over HTTP.

Each replica is a ``vllm serve`` server (:class:`~weight_transfer.engines.vllm.server.VllmServer`,
on 127.0.0.1, started from the trainers' initial weights, float32) with our
backend, driven by the controller only through vLLM's RL HTTP routes
(:func:`actors.vllm.served.connect_vllm_servers`, pause mode ``keep``), the
backend's replies on the authenticated channel. A streaming client per server
sends sampled requests (vLLM ``SamplingParams``: temperature 1, 16 tokens)
throughout, updates included. After each update, besides the checks of
``wt demo --engine vllm`` (every registered byte against vLLM's own
``load_weights`` of the trainers' weights, run in the server's workers through
a test worker extension reached by name; greedy generations against the
trainers' model; versions), the update's ``checks`` carry what the streaming
client saw: ``versions_seen`` (the weight versions in the ``weight_versions``
spans of the completions that finished since the previous update, after one
sampled by this version arrived), ``streamed`` (how many), ``spanning`` (how
many were sampled by two versions) and ``stream_errors``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from rich.progress import Progress

from actors.tools.demo.checks import capped
from actors.tools.demo.fleet import Fleet, transfer_config
from actors.tools.demo.run_config import RunConfig
from actors.tools.demo.vllm_demo import oracle_bytes, set_vllm_log_level, vllm_log_level
from actors.vllm.engine import save_trainer_checkpoint

ENGINE = "vllm-server"
PAUSE_MODE = "keep"
STREAM_PARAMS = {"max_tokens": 16, "temperature": 1.0}
STREAM_WAIT_S = 120.0  # for a completion sampled by the new version


def start_fleet(run: RunConfig, progress: Progress | None = None) -> Fleet:
    """Trainers, one vLLM server per replica (from the trainers' initial weights), streaming
    clients, and the controller after ``setup()``."""
    from actors import WeightTransferController, launch_trainers
    from actors.tools.testkit.vllm_oracle import vllm_missing

    level = vllm_log_level()
    set_vllm_log_level(level)
    if (why := vllm_missing()) is not None:
        raise RuntimeError(f"--engine {ENGINE}: {why} (install the `vllm` extra)")
    config = transfer_config(run)
    if config.engine_fp8:
        raise ValueError(f"--engine {ENGINE}: FP8 needs a CUDA GPU; run without --fp8")
    start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="wt-demo-vllm-server-"))
    handles: list[Any] = []
    try:
        trainers = launch_trainers(config, demo=run.demo_actors)
        handles.append(trainers)
        replicas = start_servers(config, trainers, workdir, handles, level)
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=config)
        ctl.setup()
        handles += [_client(s.url, config.model.vocab_size, run.seed)
                    for s in handles if hasattr(s, "url")]
    except BaseException:
        for h in reversed(handles):
            h.close()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    names = [config.cluster.replica_name(i) for i in range(len(replicas))]
    return Fleet(run=run, config=config, trainers=list(trainers),
                 replicas=dict(zip(names, replicas, strict=True)), controller=ctl,
                 setup_seconds=time.perf_counter() - start, engine=ENGINE,
                 owners=list(replicas.owners), workdir=workdir, handles=handles)


def start_servers(config: Any, trainers: Any, workdir: Path, handles: list, level: str) -> Any:
    """One server per replica from the trainers' current weights, then their handle."""
    from actors.tools.testkit.vllm_oracle_ext import EXTENSION
    from actors.vllm.served import connect_vllm_servers
    from weight_transfer.engines.vllm.channel import new_key
    from weight_transfer.engines.vllm.server import VllmServer

    first = save_trainer_checkpoint(list(trainers), workdir / "v0")
    key, tp = new_key(), config.cluster.inference.gpus_per_replica
    env = {"VLLM_LOGGING_LEVEL": level}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tp)))
    for i in range(config.cluster.inference.replicas):
        handles.append(VllmServer(first, key=key, env=env, log_path=workdir / f"server{i}.log",
                                  engine_args={"dtype": "float32", "tensor_parallel_size": tp,
                                               "worker_extension_cls": EXTENSION}))
    urls = [h.url for h in handles if hasattr(h, "url")]
    replicas = connect_vllm_servers(config, urls, key=key, pause_mode=PAUSE_MODE,
                                    reply_host="127.0.0.1", trainers=trainers)
    handles.append(replicas)
    return replicas


def _client(url: str, vocab: int, seed: int) -> Any:
    import torch

    from weight_transfer.engines.vllm.stream import StreamingClient

    gen = torch.Generator().manual_seed(seed + 7)
    prompts = torch.randint(0, vocab, (4, 8), generator=gen).tolist()
    return StreamingClient(url, prompts, STREAM_PARAMS, concurrency=2)


def _stream_checks(fleet: Fleet, version: int, checks: dict, problems: list[str]) -> None:
    from weight_transfer.engines.vllm.stream import StreamingClient, versions_seen

    clients = [h for h in fleet.handles if isinstance(h, StreamingClient)]
    done = []
    for c in clients:
        try:
            done += c.wait_for_version(version, timeout_s=STREAM_WAIT_S)
        except TimeoutError:
            done += c.last_taken
    seen = versions_seen(done)
    errors = [e for c in clients for e in c.errors]
    checks.update(versions_seen=seen, streamed=len(done),
                  spanning=sum(len(set(c.versions)) > 1 for c in done),
                  stream_errors=len(errors))
    if str(version) not in seen:
        problems.append(f"no streamed completion sampled by version {version} within "
                        f"{STREAM_WAIT_S:g} s (seen: {seen})")
    problems += capped([f"stream: {e}" for e in errors])
    for c in clients:
        c.errors.clear()


def _extension_oracle(owner: Any, checkpoint: str) -> list[tuple[list[str], dict[str, str]]]:
    """The check in the servers' test worker extension, reached by name."""
    answers = ray.get(owner.collective_rpc.remote("wt_oracle_check", (checkpoint,)))
    return [(a["problems"], a["digests"]) for a in answers]


def check_bytes(fleet: Fleet, checks: dict, problems: list[str],
                previous: dict | None) -> dict[str, dict[str, str]]:
    """Every registered byte against vLLM's load_weights in the servers' workers; the
    streaming client's versions."""
    version = max(int(v) for v in fleet.controller.weights_version().values() if v is not None)
    _stream_checks(fleet, version, checks, problems)
    return oracle_bytes(fleet, checks, problems, previous, oracle=_extension_oracle)
