"""The main job: FSDP2 trainer actors (or DeepSpeed's, ``--trainer deepspeed``) -> TP inference
replicas over the configured transport, verified.

``wt demo``, ``scripts/launch.py`` (``ray job submit``) and the tests all run
:func:`run_job`. One run:

1. joins a Ray cluster (an address in the run config, ``RAY_ADDRESS``, or, for
   ``launch.py``, a running local cluster) or starts a local instance;
2. starts the trainer actors (one per rank of the cluster config, a seeded
   transformers model sharded with FSDP2 over a gloo group) and the inference
   replicas (reference-engine TP ranks, each buffer registered with its NIC of
   the run's ``transfer.transport``: ``simnic`` by default, ``mooncake`` TCP with
   ``wt demo --transport mooncake``, ``rdma``), then
   ``WeightTransferController.setup()`` plans once and connects every NIC pair
   both ways (a transport that cannot reach a peer fails here, naming them);
3. per cycle ``v = 1..updates``: one AdamW step on the trainers, then
   ``controller.update(v)``, then the checks of :mod:`actors.tools.demo.verify`:
   every engine tensor byte-equal to the reference layout of the trainer's
   current weights (bf16 copies, or the reference FP8 quantization), greedy
   generations equal to the trainer model's token for token (bf16), logits
   within ``verify.fp8_logits_rel_tol`` of the trainer model's (FP8), every
   replica at version ``v``. Checks move digests, tokens and logits only:
   digests are computed inside the actors (``__ray_call__``), so no weights
   cross Ray's object store, for the update or for its verification;
4. prints a rich table per update, writes ``--json`` (``-``: standard output,
   everything else to standard error) and ``--trace`` (a Chrome trace of every
   update, :mod:`weight_transfer.observe.trace`) and returns 0 only when every update
   verified (the exit code of ``wt demo`` and of the job).

Progress bars (:mod:`actors.tools.cli.progress`) show the set-up and the updates on a
terminal; logs and ``--json -`` get none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
import torch
from rich.console import Console
from rich.progress import Progress

from actors.engine_registry import engine_spec
from actors.tools.cli.progress import (
    PhaseBars,
    command_console,
    emit_json,
    json_to_stdout,
    progress_bar,
)
from actors.tools.demo.checks import UpdateCheck, render_table, summary, write_json
from actors.tools.demo.fleet_handle import Fleet
from actors.tools.demo.run_config import RunConfig, load_run_config
from actors.tools.demo.verify import check_bytes, first_answer, verify
from actors.tools.engine_tools import engine_tool, has_tool
from actors.tools.ray_token import private_token
from scheduling.cluster.config import load_cluster_config
from weight_transfer.model.models import load_model_config
from weight_transfer.observe.trace import write_chrome_trace

log = logging.getLogger(__name__)
# A loopback address for a local Ray instance. Ray rewrites "127.0.0.1" to the host's
# interface address; any other 127/8 address it keeps, so Ray's traffic stays on lo.
LOCAL_NODE_IP = "127.0.0.2"


def engine_impl(engine: str, name: str) -> Callable:
    """The demo's hook ``name`` (``start_fleet(run, progress)``, ``check_bytes(fleet, checks,
    problems, previous)`` ...) of ``engine``, from the engine registry
    (:func:`actors.engine_registry.engine_spec`); imported on use."""
    return engine_tool(engine, name)


# ------------------------------------------------------------------------ Ray and actors


def connect_ray(run: RunConfig, *, join_existing: bool = False) -> bool:
    """Join or start Ray; True when this call connected (the caller disconnects).

    An explicit ``ray.address`` wins, then ``RAY_ADDRESS``; ``join_existing``
    joins a cluster started on this machine with ``ray start``; otherwise a
    local instance of ``ray.num_cpus`` logical CPUs starts on loopback.
    """
    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    address = run.ray.address or ("auto" if os.environ.get("RAY_ADDRESS") else None)
    if address is None and join_existing and _local_cluster_running():
        try:
            private_token(new_cluster=False)
            ray.init(address="auto", **quiet)
            return True
        except ConnectionError as exc:  # a stale address file: start our own
            log.warning("no Ray cluster at the last `ray start` address (%s); starting one", exc)
    if address is not None:
        private_token(new_cluster=False)  # one made before (`ray get-auth-token`): 0600
        ray.init(address=address, **quiet)
    else:  # "local": a new instance even when another one runs on this machine
        private_token(new_cluster=True)  # made 0600 here, not 0644 by ray.init
        ray.init(address="local", num_cpus=run.ray.num_cpus, include_dashboard=False,
                 _node_ip_address=LOCAL_NODE_IP, **quiet)
    return True


def _local_cluster_running() -> bool:
    """A cluster started here with ``ray start`` (its address file exists)."""
    from ray._private.services import find_bootstrap_address

    return find_bootstrap_address(None) is not None


def transfer_config(run: RunConfig, **overrides: Any) -> Any:
    """The controller's ``TransferConfig`` of a run config (its ``transfer:`` settings);
    ``overrides``: fields set otherwise than the run config says (``wt chaos``: a short
    ``update_timeout_s``, capped NICs)."""
    from actors import TransferConfig

    return TransferConfig.from_settings(
        load_model_config(run.model_path), load_cluster_config(run.cluster_path),
        settings=run.transfer, **({"fp8": run.fp8} | overrides))


def start_fleet(run: RunConfig, progress: Progress | None = None, *,
                actor_classes: dict[str, Any] | None = None, **overrides: Any) -> Fleet:
    """Actors as the cluster config places them (the engines of ``run.engine``, from its
    registered launch function), and the controller after setup() (``overrides``: see
    :func:`transfer_config`; ``actor_classes``: ``{"trainer": cls, "engine": cls}`` instead
    of the ready-made actors, e.g. :mod:`actors.tools.testkit.hooks`' classes with fault
    injection).

    Every actor started is owned by a launch handle; on an error they are closed."""
    from actors import WeightTransferController, launch_trainers
    from actors.ready.handles import Launched

    config = transfer_config(run, **overrides)
    classes = actor_classes or {}
    launch_engines = engine_spec(run.engine).launcher()
    start = time.perf_counter()
    bars = PhaseBars(progress) if progress is not None else (lambda *_: None)
    handles: list[Launched] = []
    try:
        bars("start trainer ranks", 0, 1)
        trainers = _launch(handles, launch_trainers, config,
                           classes.get("trainer") or trainer_class(run), demo=run.demo_actors)
        bars("start trainer ranks", 1, 1)
        n = config.cluster.inference.replicas
        for i in range(n):
            bars("start engine replicas", i, n)
            _launch(handles, launch_engines, config, classes.get("engine"), replicas=[i],
                    demo=run.demo_actors)
        bars("start engine replicas", n, n)
        engines = [r for h in handles[1:] for r in h]
        ctl = WeightTransferController(trainers=trainers, engines=engines, config=config)
        ctl.progress = bars if progress is not None else None
        ctl.setup()
    except BaseException:
        for h in reversed(handles):
            h.close()
        raise
    ctl.progress = None
    names = [config.cluster.replica_name(i) for i in range(len(engines))]
    return Fleet(run=run, config=config, trainers=list(trainers),
                 replicas=dict(zip(names, engines, strict=True)), controller=ctl,
                 setup_seconds=time.perf_counter() - start, engine=run.engine, handles=handles)


def trainer_class(run: RunConfig) -> Any:
    """The trainer actor class of ``run.trainer`` (None for the default: launch_trainers'
    own ``TrainerActor``)."""
    from actors.tools.demo.trainers import DEFAULT_TRAINER, trainer_actor

    return None if run.trainer == DEFAULT_TRAINER else trainer_actor(run.trainer)


def _launch(handles: list, launch: Callable, config: Any, actor_cls: Any, **kw: Any) -> Any:
    """``launch(config, ...)`` with ``actor_cls`` if given; its handle joins ``handles``."""
    handle = launch(config, **kw, **({"actor_cls": actor_cls} if actor_cls else {}))
    handles.append(handle)
    return handle


@contextlib.contextmanager
def fleet_session(run: RunConfig, fleet: Fleet | None = None, *,
                  start: Callable[..., Any] | None = None, **overrides: Any) -> Iterator[Fleet]:
    """``fleet`` as given (the caller's, left running), or one started for the block by
    ``start(run, **overrides)`` (default: :func:`start_fleet`, the reference engine's) on
    Ray (joined, or started for the block), closed after it."""
    if fleet is not None:
        yield fleet
        return
    started = connect_ray(run)
    own = None
    try:
        own = (start or start_fleet)(run, **overrides)
        yield own
    finally:
        if own is not None:
            own.close()
        if started:
            ray.shutdown()


# ------------------------------------------------------------------------ one cycle


def token_batch(vocab: int, rows: int, cols: int, *, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, cols), generator=gen).tolist()


def run_cycles(fleet: Fleet, console: Console,
               after_update: Callable[[Fleet, int], None] | None = None, *,
               traces: list | None = None,
               progress: Progress | None = None) -> list[UpdateCheck]:
    """The train-step + update + verify cycles; ``traces`` collects each update's trace."""
    run, cfg = fleet.run, fleet.config.model
    prompts = token_batch(cfg.vocab_size, run.verify.prompts, run.verify.prompt_len,
                          seed=run.seed + 99)
    rows, previous = [], None
    bar = progress.add_task("updates", total=run.updates) if progress is not None else None
    for version in range(1, run.updates + 1):
        batch = token_batch(cfg.vocab_size, run.train.batch_size, run.train.seq_len,
                            seed=run.seed * 1000 + version)
        loss = first_answer(ray.get([t.train_step.remote(batch) for t in fleet.trainers]))
        report = fleet.controller.update(version, trace=traces is not None)
        if traces is not None:
            traces.append(report.trace)
        if after_update is not None:
            after_update(fleet, version)
        start = time.perf_counter()
        checks, problems, previous = verify(
            fleet, version, prompts, previous,
            check_bytes=engine_impl(fleet.engine, "check_bytes"))
        checks.update(train_loss=loss, verify_seconds=time.perf_counter() - start)
        row = UpdateCheck(version=version, seconds=report.seconds, bytes=report.bytes,
                          stages=dict(report.stages), checks=checks, problems=problems,
                          report=report.as_dict())
        rows.append(row)
        verdict = "[green]verified[/]" if row.verified else "[bold red]NOT verified[/]"
        console.print(f"update {version}: {report.bytes / 1e6:.2f} MB in {report.seconds:.3f} s,"
                      f" loss {loss:.4f}, {verdict}")
        for p in problems:
            console.print(f"  [red]{p}[/]")
        if bar is not None:
            progress.advance(bar)
    return rows


# ------------------------------------------------------------------------ entry points


def run_job(run: RunConfig, *, join_existing: bool = False, console: Console | None = None,
            after_update: Callable[[Fleet, int], None] | None = None,
            trace_path: Path | None = None) -> int:
    """The whole job; 0 when every update verified, 1 otherwise."""
    console = console or command_console(run.json_path)
    start = time.perf_counter()
    started = connect_ray(run, join_existing=join_existing)
    fleet, traces = None, ([] if trace_path is not None else None)
    try:
        with progress_bar(console, quiet=json_to_stdout(run.json_path)) as progress:
            fleet = engine_impl(run.engine, "start_fleet")(run, progress)
            console.print(fleet.describe())
            rows = run_cycles(fleet, console, after_update, traces=traces, progress=progress)
        info, kind = fleet.info(), fleet.engine_kind
    finally:
        if fleet is not None:
            fleet.close()
        if started:
            ray.shutdown()
    console.print(render_table(rows, title=f"{run.name}: {info['model']}, {kind} engines"))
    info["total_seconds"] = total = time.perf_counter() - start
    if json_to_stdout(run.json_path):
        emit_json("-", summary(rows, **info), console)
    elif run.json_path is not None:
        write_json(Path(run.json_path), rows, **info)
    if trace_path is not None:
        write_chrome_trace(trace_path, traces)
        console.print(f"wrote {trace_path} (open in https://ui.perfetto.dev; "
                      f"`wt trace {trace_path} --png OUT` draws it)")
    ok = bool(rows) and all(r.verified for r in rows)
    verdict = "[green]all updates verified[/]" if ok else "[bold red]verification FAILED[/]"
    console.print(f"{verdict} in {total:.1f} s")
    return 0 if ok else 1


def run_cli(*, config: Path, model: Path | None, cluster: Path | None, fp8: bool | None,
            updates: int | None, json_path: Path | None, corrupt_version: int | None,
            trace_path: Path | None = None, transport: str | None = None,
            engine: str | None = None, trainer: str | None = None) -> int:
    """``wt demo``: the run config with the command line's options applied."""
    console = command_console(json_path)
    try:
        run = load_run_config(config)
        run = run.with_overrides(model=model, cluster=cluster, fp8=fp8, updates=updates,
                                 json_path=json_path, transport=transport, engine=engine,
                                 trainer=trainer)
        if corrupt_version is not None and not has_tool(run.engine,
                "corrupt_one_byte"):
            raise ValueError(f"--corrupt-version: the {run.engine} engine cannot flip a byte "
                             "(works with the reference engine)")
    except ValueError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2
    hook = None
    if corrupt_version is not None:
        corrupt = engine_tool(run.engine, "corrupt_one_byte")

        def hook(fleet: Fleet, version: int) -> None:
            if version == corrupt_version:
                corrupt(fleet, version)
    return run_job(run, console=console, after_update=hook, trace_path=trace_path)


__all__ = ["LOCAL_NODE_IP", "Fleet", "check_bytes", "connect_ray", "run_cli", "run_job",
           "start_fleet"]
