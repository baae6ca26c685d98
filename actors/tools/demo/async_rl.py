"""Asynchronous RL over served vLLM: rollouts stream while the trainers train, bounded staleness.

Rollout workers (threads here; processes or actors in a real job) stream
completions from N ``vllm serve`` replicas the whole time; the trainers take
batches from the queue, train, and after each step the controller updates
every replica (pause mode ``keep``: requests in flight continue with the new
weights). Each sample carries the weight versions that sampled its tokens
(vLLM's ``weight_versions`` spans) and the sampled tokens' logprobs, and the
loss uses them:

* staleness = the trainers' version - the oldest version in the sample;
  samples staler than ``max_lag`` are dropped;
* the others are importance-weighted: ``exp(logp_now - logp_behaviour)`` of
  the rollout (``logp_now`` from the trainers' current model, the behaviour
  logprobs from vLLM), truncated at ``is_clip``, times the REINFORCE advantage
  (reward: the share of rollout tokens in a target band, minus the batch mean).

Printed: per step the reward, loss and update; at the end the counts (used,
dropped as stale, sampled by two versions), samples/s and the staleness
histogram::

    python scripts/async_rl.py --replicas 1 --steps 4 --batch 8 --max-lag 1
"""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from rich.console import Console
from rich.table import Table

from actors.tools.demo.run_config import ROOT

log = logging.getLogger(__name__)

MODEL = ROOT / "configs" / "models" / "tiny_llama.yaml"
CLUSTER = ROOT / "configs" / "clusters" / "vllm_cpu_tp1.yaml"
TARGET = (0, 100)  # the reward's token band


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncRlSettings:
    replicas: int = 1
    steps: int = 4
    batch: int = 8
    max_lag: int = 1
    prompt_len: int = 8
    rollout_tokens: int = 16
    workers_per_replica: int = 2
    is_clip: float = 2.0
    take_timeout_s: float = 300.0  # for the next sample (the rollout workers failing)
    lr: float = 1e-3
    seed: int = 0


@dataclass
class Tally:
    produced: int = 0
    used: int = 0
    dropped_stale: int = 0
    spanning: int = 0
    staleness: Counter = field(default_factory=Counter)


def version_number(label: str) -> int:
    """A span's version as a number ("default": the starting weights, version 0)."""
    return int(label) if label.isdigit() else 0


def rollout_worker(url: str, prompts: list[list[int]], s: AsyncRlSettings, out: queue.Queue,
                   stop: threading.Event, errors: list[str]) -> None:
    """Stream completions from one replica until ``stop``; each into ``out`` (blocks when
    full: the trainers set the pace)."""
    from weight_transfer.engines.vllm.stream import stream_generate

    params = {"max_tokens": s.rollout_tokens, "min_tokens": s.rollout_tokens,
              "ignore_eos": True, "temperature": 1.0, "logprobs": 0}
    i = 0
    while not stop.is_set():
        try:
            (c,) = stream_generate(url, prompts[i % len(prompts)], params)
        except Exception as exc:  # reported at the end; the worker goes on
            errors.append(f"{url}: {type(exc).__name__}: {exc}")
            stop.wait(0.5)
            continue
        i += 1
        while not stop.is_set():
            try:
                out.put(c, timeout=0.5)
                break
            except queue.Full:
                continue


def take_batch(q: queue.Queue, s: AsyncRlSettings, version: int, tally: Tally) -> list:
    """``s.batch`` samples no staler than ``s.max_lag``; staler ones are dropped."""
    batch = []
    while len(batch) < s.batch:
        try:
            c = q.get(timeout=s.take_timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{len(batch)} of {s.batch} samples after "
                               f"{s.take_timeout_s:g} s: no rollout arrived") from None
        tally.produced += 1
        lag = version - min(version_number(v) for v in c.versions)
        tally.staleness[lag] += 1
        if lag > s.max_lag:
            tally.dropped_stale += 1
            continue
        tally.spanning += len(set(c.versions)) > 1
        batch.append(c)
    tally.used += len(batch)
    return batch


def importance_weights(trainers: list, batch: list, s: AsyncRlSettings) -> torch.Tensor:
    """``exp(logp_now - logp_behaviour)`` per rollout, truncated at ``s.is_clip``."""
    ids = [list(c.prompt) + list(c.token_ids) for c in batch]
    logits = ray.get([t.reference_logits.remote(ids) for t in trainers])[0].float()
    logp = torch.log_softmax(logits[:, s.prompt_len - 1:-1], dim=-1)
    tokens = torch.tensor([list(c.token_ids) for c in batch])
    now = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).sum(-1)
    behaviour = torch.tensor([sum(c.logprobs) for c in batch])
    return torch.exp(now - behaviour).clamp(max=s.is_clip)


def train_on(trainers: list, batch: list, s: AsyncRlSettings) -> tuple[float, float, float]:
    """One importance-weighted REINFORCE step; (mean reward, loss, mean weight)."""
    lo, hi = TARGET
    rewards = torch.tensor([sum(lo <= t < hi for t in c.token_ids) / len(c.token_ids)
                            for c in batch])
    weights = importance_weights(trainers, batch, s)
    adv = (rewards - rewards.mean()) * weights
    tokens = [list(c.prompt) + list(c.token_ids) for c in batch]
    loss = ray.get([t.train_step.remote(tokens, advantages=adv.tolist(),
                                        prompt_len=s.prompt_len) for t in trainers])[0]
    return float(rewards.mean()), float(loss), float(weights.mean())


def start(s: AsyncRlSettings, workdir: Path, handles: list) -> tuple[Any, list, Any, list]:
    """Trainers, N servers from their initial weights, the controller: (cfg, trainers, ctl,
    urls); everything started is appended to ``handles``."""
    from actors import DemoActorConfig, TransferConfig, WeightTransferController, launch_trainers
    from actors.vllm.engine import save_trainer_checkpoint
    from actors.vllm.served import connect_vllm_servers
    from weight_transfer.engines.vllm.channel import new_key
    from weight_transfer.engines.vllm.server import VllmServer

    cfg = TransferConfig.from_files(MODEL, CLUSTER, update_timeout_s=300,
                                    setup_timeout_s=300).with_replicas(s.replicas)
    trainers = launch_trainers(cfg, demo=DemoActorConfig(seed=s.seed, lr=s.lr))
    handles.append(trainers)
    first = save_trainer_checkpoint(list(trainers), workdir / "v0")
    key = new_key()
    for i in range(s.replicas):
        handles.append(VllmServer(first, key=key, log_path=workdir / f"server{i}.log",
                                  env={"VLLM_LOGGING_LEVEL": "WARNING"},
                                  engine_args={"dtype": "float32"}))
    urls = [h.url for h in handles if hasattr(h, "url")]
    replicas = connect_vllm_servers(cfg, urls, key=key, pause_mode="keep",
                                    reply_host="127.0.0.1", trainers=trainers)
    handles.append(replicas)
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    return cfg, list(trainers), ctl, urls


def run(s: AsyncRlSettings, console: Console) -> dict[str, Any]:
    """The whole loop; returns the summary printed."""
    from actors.tools.demo.fleet import token_batch

    handles: list = []
    workdir = Path(tempfile.mkdtemp(prefix="wt-async-rl-"))
    stop, errors, tally = threading.Event(), [], Tally()
    try:
        cfg, trainers, ctl, urls = start(s, workdir, handles)
        prompts = token_batch(cfg.model.vocab_size, 16, s.prompt_len, seed=s.seed + 5)
        q: queue.Queue = queue.Queue(maxsize=s.batch)
        threads = [threading.Thread(target=rollout_worker, daemon=True,
                                    args=(url, prompts, s, q, stop, errors))
                   for url in urls for _ in range(s.workers_per_replica)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        steps = []
        for version in range(1, s.steps + 1):
            batch = take_batch(q, s, version - 1, tally)
            reward, loss, weight = train_on(trainers, batch, s)
            report = ctl.update(version=version)  # rollouts keep streaming meanwhile
            steps.append({"step": version, "reward": reward, "loss": loss,
                          "mean_is_weight": weight, "update_seconds": report.seconds})
            console.print(f"step {version}: reward {reward:.3f}, loss {loss:+.4f}, mean IS "
                          f"weight {weight:.3f}, update {report.seconds:.3f} s")
        wall = time.perf_counter() - t0
        stop.set()
        return {"steps": steps, "produced": tally.produced, "used": tally.used,
                "dropped_stale": tally.dropped_stale, "spanning": tally.spanning,
                "samples_per_s": tally.produced / wall, "seconds": wall,
                "staleness": dict(sorted(tally.staleness.items())), "errors": errors[:5],
                "weights_version": ctl.weights_version()}
    finally:
        stop.set()
        for h in reversed(handles):
            h.close()
        shutil.rmtree(workdir, ignore_errors=True)


def print_summary(summary: dict[str, Any], s: AsyncRlSettings, console: Console) -> None:
    table = Table(title=f"async RL: {s.replicas} served replica(s), max_lag {s.max_lag}")
    for col in ("samples", "used", "dropped (stale)", "spanning 2 versions", "samples/s"):
        table.add_column(col, justify="right")
    table.add_row(str(summary["produced"]), str(summary["used"]),
                  str(summary["dropped_stale"]), str(summary["spanning"]),
                  f"{summary['samples_per_s']:.2f}")
    console.print(table)
    hist = Table(title="staleness (trainer version - oldest sampling version)")
    hist.add_column("lag", justify="right")
    hist.add_column("samples", justify="right")
    for lag, n in summary["staleness"].items():
        hist.add_row(str(lag), f"{n} {'#' * n}")
    console.print(hist)
    if summary["errors"]:
        console.print(f"[red]rollout errors: {summary['errors']}[/]")
