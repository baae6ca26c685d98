"""An RL loop in the style of OpenRLHF, showing what embedding weight transfer takes.

The library's part is five lines (marked ``# wt``): a config, the actors, the
controller, ``setup()`` once, ``update(version)`` after every policy step::

    cfg = TransferConfig.from_files(model_yaml, cluster_yaml)                   # wt
    trainers, replicas = launch_trainers(cfg), launch_engines(cfg)              # wt
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)  # wt
    ctl.setup()                                                                 # wt
    for it in range(iterations):
        rollouts = sample on the replicas (prompts split over replicas)
        rewards = toy_reward(rollouts); advantages = rewards - mean(rewards)
        trainers: REINFORCE step on prompt + rollout, weighted by the advantages
        ctl.update(version=it + 1)                                              # wt

Rollouts are sampled token by token from the engines' logits (temperature
``rl.temperature``; 0 means greedy, the engines' own ``generate``), so they come
from the weights the last update put there. The reward is the fraction of
rollout tokens in ``[rl.target_start, rl.target_end)``. Run it with::

    python scripts/rl_loop.py --config configs/runs/rl_loop.yaml [--iterations N] [--json PATH]

Every rollout says which weight versions produced its tokens
(:class:`weight_transfer.sync.versions.Generation`). With ``--overlap`` the next
iteration's rollouts are sampled while the policy step and the update run
(asynchronous RL, one step off-policy: a rollout may straddle an update); ``--max-lag N`` drops the
rollouts whose oldest token is more than N versions behind the trainers' weights
before the policy step, and each iteration prints how many it dropped.

With ``--engine vllm`` the replicas are real vLLM engines
(:func:`actors.vllm.engine.launch_vllm_engines`, float32, started from the
trainers' initial weights) and vLLM samples the rollouts itself (seeded
``SamplingParams``); the weight updates are the same five lines::

    python scripts/rl_loop.py --engine vllm --cluster configs/clusters/vllm_cpu_tp1.yaml
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
import torch
import typer
from rich.console import Console
from rich.table import Table

from actors.engine_registry import engine_spec
from actors.tools.demo.checks import make_console
from actors.tools.demo.fleet import connect_ray, token_batch
from actors.tools.demo.run_config import RlConfig, RunConfig, load_run_config
from actors.tools.engine_tools import engine_tool, has_tool
from weight_transfer.sync.versions import Generation, VersionRecorder, fresh

log = logging.getLogger(__name__)


def sample_rollouts(replica: list, prompts: list[list[int]], rl: RlConfig,
                    gen: torch.Generator, engine: str = "reference") -> list[Generation]:
    """``rl.rollout_tokens`` new tokens per prompt from one replica, as ``engine`` samples
    (its registry hook ``sample_rollouts``; a vLLM replica samples itself, once), each with
    the weight versions that produced its tokens."""
    return engine_tool(engine, "sample_rollouts")(replica, prompts, rl, gen)


def reference_rollouts(replica: list, prompts: list[list[int]], rl: RlConfig,
                       gen: torch.Generator) -> list[Generation]:
    """The reference engine's rollouts: all its TP ranks called, sampled here from the
    logits (greedy: the engines' own ``generate_tagged``); each token's version is the one
    the engine held for its step."""
    if rl.temperature == 0:
        return ray.get([a.generate_tagged.remote(prompts, rl.rollout_tokens)
                        for a in replica])[0]
    ids = torch.tensor(prompts, dtype=torch.long)
    rec = VersionRecorder(len(prompts))
    for _ in range(rl.rollout_tokens):
        version, logits = ray.get([a.tagged_logits.remote(ids) for a in replica])[0]
        rec.step(version)
        probs = torch.softmax(logits[:, -1].float() / rl.temperature, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return rec.generations(ids[:, len(prompts[0]):].tolist())


def toy_reward(rollout: list[int], rl: RlConfig) -> float:
    """Fraction of the rollout's tokens in the target band."""
    return sum(rl.target_start <= t < rl.target_end for t in rollout) / len(rollout)


def advantages_of(rewards: list[float]) -> list[float]:
    """REINFORCE with a mean baseline."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def draw_rollouts(it: int, replicas: list[list], run: RunConfig, vocab: int,
                  gen: torch.Generator) -> tuple[list[list[int]], list[Generation]]:
    """Iteration ``it``'s prompts and their rollouts, the prompts split over the replicas
    (like OpenRLHF)."""
    rl = run.rl
    prompts = token_batch(vocab, rl.prompts, rl.prompt_len, seed=run.seed * 1000 + it)
    share = math.ceil(len(prompts) / len(replicas))
    rollouts: list[Generation] = []
    for k, replica in enumerate(replicas):
        chunk = prompts[k * share:(k + 1) * share]
        if chunk:
            rollouts += sample_rollouts(replica, chunk, rl, gen, run.engine)
    return prompts, rollouts


def rl_iteration(it: int, trainers: list, replicas: list[list], ctl, run: RunConfig,
                 vocab: int, gen: torch.Generator, drawn: Future | None = None,
                 ahead: ThreadPoolExecutor | None = None) -> tuple[dict, Future | None]:
    """Rollouts (``drawn``: sampled ahead, during the last step and update), rewards, one
    policy-gradient step on the rollouts at most ``rl.max_lag`` versions old, one weight
    update; with ``ahead`` the next iteration's rollouts are sampled meanwhile (returned)."""
    rl = run.rl
    prompts, gens = drawn.result() if drawn is not None else draw_rollouts(
        it, replicas, run, vocab, gen)
    kept, dropped = (fresh(gens, current=it, max_lag=rl.max_lag) if rl.max_lag is not None
                     else (list(range(len(gens))), 0))
    rollouts = [list(g.tokens) for g in gens]
    rewards = [toy_reward(r, rl) for r in rollouts]
    nxt = None  # asynchronous RL: the next rollouts sample during the step and the update
    if ahead is not None and it + 1 < rl.iterations:
        nxt = ahead.submit(draw_rollouts, it + 1, replicas, run, vocab, gen)
    loss = None
    if kept:  # the trainers hold version ``it``: staleness is measured against it
        tokens = [prompts[i] + rollouts[i] for i in kept]
        adv = advantages_of([rewards[i] for i in kept])
        loss = ray.get([t.train_step.remote(tokens, advantages=adv, prompt_len=rl.prompt_len)
                        for t in trainers])[0]
    report = ctl.update(version=it + 1)                                         # wt
    return {"iteration": it + 1, "mean_reward": sum(rewards) / len(rewards),
            "rewards": rewards, "loss": loss, "update_seconds": report.seconds,
            "update_bytes": report.bytes, "weights_version": ctl.weights_version(),
            "versions": [list(g.versions) for g in gens], "kept": len(kept),
            "dropped": dropped}, nxt


def launch_replicas(cfg, run: RunConfig, trainers: list, workdir: Path) -> Any:
    """The run's engines, a launch handle owning them: the registry's ``launch_replicas``
    hook of ``run.engine`` where it has one (vLLM starts from the trainers' weights), else
    its launch function (engines that start with any weights: update 0 fills them)."""
    spec = engine_spec(run.engine)
    if has_tool(run.engine, "launch_replicas"):
        return engine_tool(run.engine, "launch_replicas")(cfg, trainers, workdir)
    return spec.launcher()(cfg)


def _iterate(trainers, replicas, ctl, run: RunConfig, vocab: int, gen: torch.Generator,
             console: Console) -> list[dict]:
    history, drawn = [], None
    with ThreadPoolExecutor(1, thread_name_prefix="rollouts") as pool:
        ahead = pool if run.rl.overlap else None
        for it in range(run.rl.iterations):
            rec, drawn = rl_iteration(it, trainers, replicas, ctl, run, vocab, gen, drawn,
                                      ahead)
            console.print(f"iteration {rec['iteration']}: mean reward {rec['mean_reward']:.3f}, "
                          f"loss {_loss(rec['loss'])}, update {rec['update_bytes'] / 1e6:.2f} MB "
                          f"in {rec['update_seconds']:.3f} s, versions {rec['weights_version']}"
                          + _dropped(rec, run.rl))
            history.append(rec)
    return history


def _loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:+.4f}"


def _dropped(rec: dict, rl: RlConfig) -> str:
    if rl.max_lag is None:
        return ""
    return (f", dropped {rec['dropped']} of {rec['dropped'] + rec['kept']} rollouts more "
            f"than {rl.max_lag} versions old")


def rl_transfer_config(run: RunConfig) -> Any:
    """The run's :class:`~actors.TransferConfig` (model, cluster, FP8, ``transfer:``)."""
    from actors import TransferConfig

    return TransferConfig.from_files(run.model_path, run.cluster_path, fp8=run.fp8,  # wt
                                     **dict(run.transfer))


def launch_rl_actors(run: RunConfig, cfg: Any, workdir: Path) -> tuple[Any, Any]:
    """The run's trainers (its seed, ``rl.lr``) and replicas: launch handles the caller
    closes (the trainers closed here when the replicas fail to start)."""
    from actors import DemoActorConfig, launch_trainers

    demo = DemoActorConfig(seed=run.seed, lr=run.rl.lr)  # the ready-made trainers'
    trainers = launch_trainers(cfg, demo=demo)                                  # wt
    try:
        return trainers, launch_replicas(cfg, run, trainers, workdir)           # wt
    except BaseException:
        trainers.close()
        raise


def run_rl(run: RunConfig, console: Console, *,
           actors: tuple[Any, Any] | None = None) -> list[dict]:
    """The whole loop; returns one record per iteration. On a fresh set of actors, closed
    at the end, or on ``actors``: the ``(trainers, replicas)`` :func:`launch_rl_actors`
    started for this run's model and cluster, left running for the caller (a controller of
    this run is set up over them, whatever an earlier run's controller left there)."""
    import tempfile

    from actors import WeightTransferController

    started = connect_ray(run, join_existing=True)
    trainers, replicas, ctl = [], [], None
    workdir = Path(tempfile.mkdtemp(prefix="wt-rl-"))
    try:
        cfg = rl_transfer_config(run)
        trainers, replicas = actors if actors is not None else launch_rl_actors(run, cfg,
                                                                                workdir)
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)  # wt
        ctl.setup()                                                             # wt
        ctl.update(version=0)  # the replicas start from the trainers' initial weights
        gen = torch.Generator().manual_seed(run.seed)
        return _iterate(trainers, replicas, ctl, run, cfg.model.vocab_size, gen, console)
    finally:
        if ctl is not None:
            ctl.shutdown()
        if actors is None:
            for handle in (replicas, trainers):  # launch handles: engines, actors, groups
                if hasattr(handle, "close"):
                    handle.close()
        shutil.rmtree(workdir, ignore_errors=True)
        if started:
            ray.shutdown()


def main(
    config: Path = typer.Option(Path("configs/runs/rl_loop.yaml"), help="Run config."),
    iterations: int | None = typer.Option(None, min=1, help="RL iterations [rl.iterations]."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the history."),
    engine: str | None = typer.Option(
        None, help="reference or vllm (real vLLM engines) [default: from --config]."),
    cluster: Path | None = typer.Option(None, help="Cluster YAML [default: from --config]."),
    max_lag: int | None = typer.Option(
        None, min=0, help="Drop rollouts more than this many versions old [rl.max_lag]."),
    overlap: bool | None = typer.Option(
        None, "--overlap/--no-overlap",
        help="Sample the next rollouts during the update [rl.overlap]."),
) -> None:
    """Rollouts on the inference replicas, REINFORCE on the trainers, weight updates."""
    console = make_console()
    try:
        run = load_run_config(config).with_overrides(engine=engine, cluster=cluster)
        rl = {"iterations": iterations, "max_lag": max_lag, "overlap": overlap}
        rl = {k: v for k, v in rl.items() if v is not None}
        if rl:
            run = run.with_overrides(rl={**run.rl.model_dump(), **rl})
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    start = time.perf_counter()
    history = run_rl(run, console)
    table = Table(title=f"{run.name}: REINFORCE towards tokens "
                        f"[{run.rl.target_start}, {run.rl.target_end})")
    for col in ("iteration", "mean reward", "loss", "update s", "MB", "dropped"):
        table.add_column(col, justify="right")
    for r in history:
        table.add_row(str(r["iteration"]), f"{r['mean_reward']:.3f}", _loss(r["loss"]),
                      f"{r['update_seconds']:.3f}", f"{r['update_bytes'] / 1e6:.2f}",
                      f"{r['dropped']}/{r['dropped'] + r['kept']}")
    console.print(table)
    console.print(f"done in {time.perf_counter() - start:.1f} s")
    if json_path is not None:
        json_path.write_text(json.dumps(history, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
