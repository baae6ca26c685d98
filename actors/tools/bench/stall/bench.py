"""``wt bench stall``: how long the engines stop serving per update, in place and in shadow mode.

On the demo cluster (reference engine: 4 trainer ranks -> 2 replicas x TP2, tiny
Llama), one Ray run, the same actors for both modes: a client generates
continuously on every replica (one request after another, every TP rank
together) while updates run, first with ``apply="in_place"`` (pause, transfer,
check, resume), then with a second controller set up with ``apply="shadow"``
(transfer and check while serving, then a flip). Per mode:

* ``stall_s``: the engine's stall per update, the longest gap between two
  consecutive generation steps (their start times, recorded by the engine) whose
  interval overlaps the update; the largest over updates and replicas;
* ``update_s``: the seconds of ``ctl.update()`` (mean over updates);
* ``extra_engine_bytes``: memory the mode adds to the engines (the shadows);
* ``step_gap_s``: the median gap between steps outside updates (what a stall
  compares with: the engine's own step time on this machine);
* ``idle_stall_s``: the engine's noise floor, the same measure with no update: the
  generation runs :data:`IDLE_S` seconds alone before the mode's updates, that time is
  cut into windows as long as the mode's median update (the whole time when an update
  is longer), and this is the median over those windows of their longest step gap (on
  two shared cores the engines' own steps jitter: a stall can not be told from noise
  below it);
* ``added_stall_s``: ``stall_s`` less ``idle_stall_s`` (0 when below): what the update
  itself adds to the longest gap;
* ``engine_pause_s``: the longest time an engine rank held generation per update,
  by the engine's own clock (in place: its pause at the step boundary to its resume;
  shadow: its flip, from the boundary to going on);
* ``verified``: every update's engine bytes equal the trainers' weights.

    wt bench stall --json stall.json          # modes -> in_place / shadow -> stall_s ...

``--engine`` chooses the engine's client from :data:`STALL_CLIENTS` (how to
generate on one replica and read its step times): ``reference``, or ``vllm``
(:mod:`actors.tools.bench.stall.vllm`: one real vLLM replica, TP=2, from
``configs/runs/demo_vllm.yaml`` unless ``--config`` names another; its steps are
vLLM's engine steps, its bytes checked against vLLM's own load_weights). The fleet
and its byte check come from the engine registry (``start_fleet``, ``check_bytes``).
Here trainers and engines share the machine's cores (on a
cluster they are different GPUs): the trainer processes run at the lowest CPU priority
in both modes, so that the transfer's CPU work does not pass for an engine stall.

``run(..., fleet=fleet)`` measures a fleet the caller started (in place; the tests share
one vLLM fleet with ``wt bench designs``) and leaves it running; its versions go on above
the fleet controller's (:mod:`actors.tools.bench.caller_fleet`). The shadow mode leaves the
fleet's controller shut down and its engines set up for shadow mode (a vLLM engine cannot
go back to in place): on a shared fleet, run it last.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from rich.table import Table

from actors.engine_registry import engine_spec
from actors.tools.bench.caller_fleet import check_fleet, next_version
from actors.tools.bench.stall.vllm import VllmStallClient
from actors.tools.cli.progress import command_console, emit_json, json_to_stdout
from actors.tools.demo.fleet import Fleet, fleet_session, token_batch
from actors.tools.demo.run_config import RunConfig, load_run_config
from actors.tools.engine_tools import engine_tool

MODES = ("in_place", "shadow")
WARMUP_S = 1.0  # client requests before the first update (steps flowing)
IDLE_S = 3.0  # generation alone before the updates: the engine's noise floor
FLOWING_S = 300.0  # the longest the bench waits for every replica's first answer
SETTLE_S = 0.5  # client requests after each update (the steps after the flip)


def stall_of(steps: Sequence[float], start: float, end: float) -> float:
    """The longest gap between consecutive step starts whose interval overlaps
    ``[start, end]`` (0 when fewer than two steps bracket it)."""
    times = sorted(steps)
    gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
    return max(gaps, default=0.0)


def wait_within(steps: Sequence[float], start: float, end: float) -> float:
    """The longest time inside ``[start, end]`` with no step starting: each gap between
    consecutive step starts clipped to the window, so a wait that began before the window
    (a slow request, a process not scheduled) counts only for the part the window holds.
    ``end - start`` when no step starts inside it and none brackets it either."""
    times = sorted(t for t in steps)
    inside = [start] + [t for t in times if start < t < end] + [end]
    return max(b - a for a, b in itertools.pairwise(inside))


def idle_floor(steps: Sequence[float], start: float, end: float, window: float) -> float:
    """The median, over consecutive windows of ``window`` seconds in ``[start, end]``, of
    the longest step gap overlapping each; when ``window`` is longer than the span (an
    update longer than the idle time: vLLM's), the span is the one window (a floor
    from a shorter window, so if anything lower). 0 for an empty window."""
    if window <= 0:
        return 0.0
    edges = [start + i * window for i in range(int((end - start) // window))]
    if not edges:
        return stall_of(steps, start, end)
    return statistics.median([stall_of(steps, a, a + window) for a in edges])


def idle_gap(steps: Sequence[float], windows: Sequence[tuple[float, float]]) -> float:
    """The median gap between consecutive steps that overlap no update window."""
    times = sorted(steps)
    gaps = [b - a for a, b in itertools.pairwise(times)
            if not any(b >= s and a <= e for s, e in windows)]
    return statistics.median(gaps) if gaps else 0.0


class ReferenceClient:
    """Requests on a reference-engine replica and its ranks' step times."""

    def __init__(self, fleet: Fleet, *, prompt_len: int = 8, max_new_tokens: int = 16) -> None:
        cfg = fleet.config.model
        self.replicas, self.max_new_tokens = fleet.replicas, max_new_tokens
        self.prompts = token_batch(cfg.vocab_size, 2, prompt_len, seed=7)

    def generate(self, replica: str) -> None:
        ray.get([a.generate.remote(self.prompts, self.max_new_tokens)
                 for a in self.replicas[replica]])

    def step_times(self, replica: str, since: float) -> list[float]:
        return ray.get(self.replicas[replica][0].step_times.remote(since))


# engine name -> the client wt bench stall drives it with (another engine adds its own)
STALL_CLIENTS: dict[str, Callable[[Fleet], Any]] = {"reference": ReferenceClient,
                                                    "vllm": VllmStallClient}


@dataclass(slots=True)
class ModeResult:
    """One mode's numbers (see the module docstring)."""

    mode: str
    stall_s: float = 0.0
    update_s: float = 0.0
    extra_engine_bytes: int = 0
    step_gap_s: float = 0.0
    idle_stall_s: float = 0.0
    added_stall_s: float = 0.0
    engine_pause_s: float = 0.0
    verified: bool = True
    stalls: list[float] = field(default_factory=list)
    pauses: list[float] = field(default_factory=list)
    updates: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class Clients:
    """One thread per replica generating until :meth:`stop`."""

    def __init__(self, client: Any, replicas: Sequence[str]) -> None:
        self.client, self.done = client, threading.Event()
        self.errors: list[str] = []
        self.served: set[str] = set()  # replicas that answered a request
        self.threads = [threading.Thread(target=self._loop, args=(n,), daemon=True)
                        for n in replicas]

    def _loop(self, name: str) -> None:
        while not self.done.is_set():
            try:
                self.client.generate(name)
            except Exception as exc:  # noted; the run is not verified then
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                return
            self.served.add(name)

    def wait_flowing(self, timeout_s: float = FLOWING_S) -> None:
        """Until every replica answered one request (vLLM's first ones are slow), at most
        ``timeout_s``: the idle floor is measured while steps flow."""
        end = time.monotonic() + timeout_s
        while len(self.served) < len(self.threads) and not self.errors \
                and time.monotonic() < end:
            time.sleep(0.05)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=60)


def lowest_priority(niceness: int = 19) -> int:
    """Every thread of this process at ``niceness`` (Linux: a nice value is per thread, and
    Ray's and the transfer's threads were made before); returns how many were set."""
    done = 0
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
            done += 1
    return done


def renice(actors: Sequence[Any], niceness: int = 19) -> None:
    """Lowest CPU priority for every thread of ``actors``' processes: here trainers and
    engines share two cores, on a cluster they run on different GPUs, so the transfer's CPU
    must not pass for an engine stall (both modes run so; again before each update, for
    the threads made since)."""
    ray.get([a.__ray_call__.remote(lambda self: lowest_priority(niceness)) for a in actors])


def measure(fleet: Fleet, ctl: Any, client: Any, mode: str, versions: range) -> ModeResult:
    """Updates ``versions`` through ``ctl`` while every replica generates; the mode's row."""
    out = ModeResult(mode=mode, extra_engine_bytes=sum(ctl.summary.shadow_bytes.values()))
    names, windows, since = list(ctl.replicas), [], time.time()
    cfg, run = fleet.config.model, fleet.run
    with Clients(client, names) as clients:
        clients.wait_flowing()
        time.sleep(WARMUP_S)
        idle = (time.time(), time.time() + IDLE_S)
        time.sleep(IDLE_S)
        for version in versions:
            batch = token_batch(cfg.vocab_size, run.train.batch_size, run.train.seq_len,
                                seed=run.seed * 1000 + version)
            ray.get([t.train_step.remote(batch) for t in fleet.trainers])
            time.sleep(SETTLE_S)  # steps back to their pace after the train step's CPU load
            renice(fleet.trainers)
            start = time.time()
            report = ctl.update(version)
            windows.append((start, time.time()))
            out.updates.append(report.seconds)
            out.pauses.append(engine_pause(ctl, mode, start))
            time.sleep(SETTLE_S)  # steps after the update, before the checks load the engines
            checks: dict = {}
            engine_tool(fleet.engine, "check_bytes")(fleet, checks, out.problems, None)
            out.verified &= bool(checks.get("bytes"))
    out.problems += clients.errors
    out.verified &= not clients.errors
    steps = {n: client.step_times(n, since) for n in names}
    out.stalls = [max(stall_of(steps[n], s, e) for n in names) for s, e in windows]
    out.stall_s, out.update_s = max(out.stalls), statistics.mean(out.updates)
    out.engine_pause_s = max(out.pauses)
    out.step_gap_s = max(idle_gap(steps[n], windows) for n in names)
    span = statistics.median([e - s for s, e in windows])
    out.idle_stall_s = max(idle_floor(steps[n], *idle, span) for n in names)
    out.added_stall_s = max(0.0, out.stall_s - out.idle_stall_s)
    return out


def engine_pause(ctl: Any, mode: str, since: float) -> float:
    """The longest time an engine rank held generation in the update that started at
    ``since``, by the engine's own clock: in place from its pause (at the step boundary)
    to its resume; in shadow mode its flip (from the boundary to going on)."""
    ranks = [a for r in ctl.replicas.values() for a in r]
    if mode == "shadow":
        return max(i.last_flip_s for i in ray.get([a.wt_shadow_info.remote() for a in ranks]))
    held = 0.0
    for events in ray.get([a.wt_events.remote() for a in ranks]):
        paused = [t for e, _, t in events if e == "pause" and t >= since]
        resumed = [t for e, _, t in events if e == "resume" and t >= since]
        if paused and resumed:
            held = max(held, resumed[-1] - paused[0])
    return held


def shadow_controller(fleet: Fleet) -> Any:
    """A second controller over the same actors, in shadow mode (set up)."""
    from actors import WeightTransferController

    ctl = WeightTransferController(trainers=fleet.trainers, engines=list(fleet.replicas.values()),
                                   config=fleet.config.replace(apply="shadow"))
    ctl.setup()
    return ctl


def render(rows: list[ModeResult]) -> Table:
    table = Table(title="engine stall per update (longest gap between engine steps)")
    for col in ("mode", "stall (ms)", "idle floor (ms)", "added (ms)", "step gap (ms)",
                "engine pause (ms)", "update (s)", "extra engine MB", "verified"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        table.add_row(r.mode, f"{r.stall_s * 1e3:.1f}", f"{r.idle_stall_s * 1e3:.1f}",
                      f"{r.added_stall_s * 1e3:.1f}", f"{r.step_gap_s * 1e3:.1f}",
                      f"{r.engine_pause_s * 1e3:.1f}",
                      f"{r.update_s:.3f}", f"{r.extra_engine_bytes / 1e6:.1f}",
                      "yes" if r.verified else "[red]no[/]")
    return table


def engine_fleet(run_cfg: RunConfig, fleet: Fleet | None = None,
                 **overrides: Any) -> contextlib.AbstractContextManager[Fleet]:
    """``fleet`` as given (the caller's, left running), or the run's fleet, started by its
    engine's registered ``start_fleet`` (the demo's fleet for the reference engine), closed
    after the block."""
    start = None if run_cfg.engine == "reference" else engine_tool(run_cfg.engine, "start_fleet")
    return fleet_session(run_cfg, fleet, start=start, **overrides)


def run_config_for(config: Path | None, engine: str, cluster: Path | None = None) -> RunConfig:
    """``config`` (default: the engine's demo config), run with ``engine`` on ``cluster``
    (default: the config's)."""
    path = Path(engine_spec(engine).demo_config) if config is None else config
    run_cfg = load_run_config(path)
    if run_cfg.engine == engine and cluster is None:
        return run_cfg
    return run_cfg.with_overrides(engine=engine, cluster=cluster)


def check_args(engine: str, updates: int, nic_gbps: float | None, cluster: Path | None,
               fleet: Fleet | None) -> None:
    """ValueError naming the argument that :func:`run` cannot take."""
    if nic_gbps is not None and nic_gbps <= 0:
        raise ValueError(f"--nic-gbps must be positive, not {nic_gbps}")
    if engine not in STALL_CLIENTS:
        raise ValueError(f"wt bench stall: no client for engine {engine!r} (known: "
                         f"{sorted(STALL_CLIENTS)}); add one to STALL_CLIENTS")
    if updates < 1:
        raise ValueError(f"--updates must be at least 1, not {updates}")
    if fleet is None:
        return
    check_fleet(fleet, engine, "wt bench stall")
    if fleet.config.apply != "in_place":
        raise ValueError(f"wt bench stall: fleet= is set up with apply={fleet.config.apply!r}; "
                         "the bench starts in place (its shadow mode sets up a controller "
                         "of its own)")
    if nic_gbps is not None or cluster is not None:
        raise ValueError("wt bench stall: nic_gbps and cluster choose the fleet the bench "
                         "starts; with fleet= the fleet's own caps and cluster apply")


def run(*, config: Path | None, engine: str = "reference", updates: int = 3,
        nic_gbps: float | None = None, json_out: Path | None = None,
        cluster: Path | None = None, fleet: Fleet | None = None) -> int:
    """Both modes on one fleet; exit 1 unless every update verified. ``nic_gbps`` caps
    every NIC (GB/s) in both modes: a transfer as long, against the engine's steps, as on
    a cluster whose NICs bind (uncapped, tiny Llama's transfer here is a few steps).
    ``cluster`` replaces the run config's cluster YAML (e.g. a vLLM replica at TP1).
    ``fleet``: measure these actors (the caller's, in place, left running) instead of
    starting the engine's fleet (see the module docstring)."""
    check_args(engine, updates, nic_gbps, cluster, fleet)
    console = command_console(json_to_stdout(json_out))
    run_cfg = run_config_for(config, engine, cluster)
    rows: list[ModeResult] = []
    caps = {} if nic_gbps is None else {"nic_gbps": nic_gbps}
    with engine_fleet(run_cfg, fleet, apply="in_place", **caps) as active:
        renice(active.trainers)
        client = STALL_CLIENTS[engine](active)
        first = next_version(active.controller)  # 1 on a fleet the bench started
        rows.append(measure(active, active.controller, client, "in_place",
                            range(first, first + updates)))
        active.controller.shutdown()
        shadow = shadow_controller(active)  # fleet.config: the caps too
        try:
            rows.append(measure(active, shadow, client, "shadow",
                                range(first + updates, first + 2 * updates)))
        finally:
            shadow.shutdown()
    report(console, rows)
    verified = all(r.verified for r in rows)
    if json_out is not None:
        emit_json(json_out, {"engine": engine, "updates": updates, "nic_gbps": nic_gbps,
                             "verified": verified,
                             "modes": {r.mode: asdict(r) for r in rows}}, console=console)
    return 0 if verified else 1


def report(console: Any, rows: list[ModeResult]) -> None:
    """The table, shadow against in place per measure, and every problem."""
    console.print(render(rows))
    for what in ("stall_s", "added_stall_s", "engine_pause_s"):
        base, sh = getattr(rows[0], what), getattr(rows[1], what)
        console.print(f"{what}: shadow {sh * 1e3:.1f} ms = {sh / base:.1%} of in place "
                      f"({base * 1e3:.1f} ms)" if base else f"{what}: none in place")
    for r in rows:
        for p in r.problems:
            console.print(f"[red]{r.mode}: {p}[/]")
