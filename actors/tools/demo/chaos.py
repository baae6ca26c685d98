"""``wt chaos``: every fault of docs/reliability.md against the demo cluster, one after another.

The demo's actors (:func:`actors.tools.demo.fleet.start_fleet`: trainer ranks, engine
replicas, the controller) run with a short ``update_timeout_s`` and capped
NICs, so that an update's writes last long enough for a fault to land during
them. For each fault (:data:`FAULTS`, in order): a train step, the fault
injected (before the update, or from the controller's ``transfer`` progress
hook right after every trainer got "go"), one update, the outcome judged, then
the recovery the fault needs (the next update alone, ``resync``, ``setup()``
again, new trainers, or a new replica through ``add_replica``) and one more
update verified byte for byte against the trainers' weights::

    wt chaos                           # a table: fault, outcome, detect s, torn, healed
    wt chaos --json chaos.json         # rows with fault, ok, detect_s, healed, ...
    wt chaos --faults nic-link-down,region-revoked
    wt chaos --apply shadow            # the same faults, judged as transactions

A row is ``ok`` when the update ended within its bound (``update_timeout_s``
plus the hold wait and a re-plan margin) in a clear outcome: an
``UpdateError`` naming the faulty actor, every other replica at the new
version, every torn replica paused with version None, dropped (dead) or
re-synced; or, for a transient NIC fault under a retry policy, the update
succeeding. ``healed``: the recovery and the next update left every replica
serving the new version, every engine byte equal to the trainers'. The exit
code is 0 only when every row is ok and healed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from rich.console import Console
from rich.table import Table

from actors.tools.cli.progress import command_console, emit_json, json_to_stdout
from actors.tools.demo.chaos_shadow import ServingProbe, judge_shadow
from actors.tools.demo.fleet import Fleet, fleet_session, token_batch
from actors.tools.demo.run_config import RunConfig, load_run_config
from actors.tools.demo.verify import check_bytes
from actors.tools.testkit.hooks import FaultyInferenceActor, FaultyTrainerActor

VICTIM = "engine1"  # the replica the engine faults hit (the demo has engine0 and engine1)
# The actors chaos starts: the ready-made ones with the test-only fault hooks
# (actors.tools.testkit.hooks).
FAULTY_ACTORS = {"trainer": FaultyTrainerActor, "engine": FaultyInferenceActor}
BOUND_MARGIN_S = 30.0  # beyond update_timeout_s: hold wait, dropping a replica, a re-sync


@dataclass(slots=True)
class ChaosRow:
    """One fault: what happened, how fast it was detected, whether the recovery healed."""

    fault: str
    ok: bool
    detect_s: float | None
    healed: bool
    outcome: str
    torn: list[str] = field(default_factory=list)
    recovery: str = ""
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Fault:
    """How to inject one fault, what its error must name, and how to recover."""

    before: Callable[[Chaos], None] | None = None
    during: Callable[[Chaos], None] | None = None
    after: Callable[[Chaos], None] | None = None
    names: Callable[[Chaos], list[str]] = lambda ch: []
    recover: Callable[[Chaos], None] = lambda ch: None
    recovery: str = "next update"
    may_succeed: bool = False  # a transient fault that a retry policy absorbs


class Chaos:
    """The fleet under test and the faults' shared state (a victim's pid, the version)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.ctl = fleet, fleet.controller
        self.version = max((v for v in self.ctl.weights_version().values() if v), default=0)
        self.injected_at = 0.0
        self.pid = 0
        self.apply = fleet.config.apply
        self.kept: dict[int, dict] = {}  # version -> engine digests when it was verified

    def engine(self, rank: int = 1) -> Any:
        return self.ctl.replicas[VICTIM][rank]

    def trainer(self, rank: int) -> Any:
        return self.fleet.trainers[rank]

    def train(self) -> None:
        cfg, run = self.fleet.config.model, self.fleet.run
        batch = token_batch(cfg.vocab_size, run.train.batch_size, run.train.seq_len,
                            seed=run.seed * 1000 + self.version + 1)
        ray.get([t.train_step.remote(batch) for t in self.fleet.trainers])

    def serving(self, name: str) -> list[tuple[bool, int | None]]:
        """(paused, version) each engine rank of ``name`` reports."""
        return [(ray.get(a.wt_paused.remote(), timeout=30), ray.get(a.wt_version.remote(),
                                                                   timeout=30))
                for a in self.ctl.replicas[name]]

    def held(self, name: str, wait_s: float = 10.0) -> bool:
        """Every rank of ``name`` paused with version None (a rank that just continued
        runs its queued commands first: give it ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if all(s == (True, None) for s in self.serving(name)):
                    return True
            except (ray.exceptions.RayError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def verified_update(self) -> list[str]:
        """Train, update, check every replica: version, serving, bytes. The problems."""
        self.train()
        self.version += 1
        try:
            self.ctl.update(self.version)
        except Exception as exc:  # the healing update itself failed: say so
            return [f"update {self.version}: {type(exc).__name__}: {exc}"]
        problems = [f"{n}: holds {v}, expected {self.version}"
                    for n, v in self.ctl.weights_version().items() if v != self.version]
        problems += [f"{n}: (paused, version) {s}" for n in self.ctl.replicas
                     if (s := self.serving(n)) != [(False, self.version)] * len(s)]
        self.fleet.replicas = {n: self.ctl.replicas[n] for n in sorted(self.ctl.replicas)}
        self.fleet.trainers = list(self.ctl.trainers)
        got = check_bytes(self.fleet, {}, problems, None)
        if not problems:
            self.kept[self.version] = got
        return problems


# ------------------------------------------------------------------------ the faults


def _mark(ch: Chaos) -> None:
    ch.injected_at = time.monotonic()


def _kill_engine(ch: Chaos) -> None:
    _mark(ch)
    ray.kill(ch.engine())


def _stop_engine(ch: Chaos) -> None:
    _mark(ch)
    os.kill(ch.pid, signal.SIGSTOP)


def _remember_pid(ch: Chaos) -> None:
    ch.pid = ray.get(ch.engine().__ray_call__.remote(lambda self: os.getpid()))


def _stop_engine_now(ch: Chaos) -> None:
    _remember_pid(ch)
    _stop_engine(ch)


def _revoke_region(ch: Chaos) -> None:
    _mark(ch)
    ray.get(ch.engine(0).wt_deregister.remote())


def _kill_trainer(ch: Chaos) -> None:
    _mark(ch)
    ray.kill(ch.trainer(1))


def _replace_trainers(ch: Chaos) -> None:
    from actors import launch_trainers

    for t in ch.ctl.trainers:  # the survivors' process group lost a member
        ray.kill(t)
    ch.fleet.trainers = list(ch.fleet.adopt(launch_trainers(ch.fleet.config,
                                                             actor_cls=FaultyTrainerActor,
                                                             demo=ch.fleet.run.demo_actors)))
    ch.ctl.setup(trainers=ch.fleet.trainers)


def _new_replica(ch: Chaos) -> None:
    from actors import launch_engines

    index = int(VICTIM.removeprefix("engine"))
    (actors,) = ch.fleet.adopt(launch_engines(ch.fleet.config, replicas=[index],
                                              actor_cls=FaultyInferenceActor,
                                              demo=ch.fleet.run.demo_actors))
    ch.ctl.add_replica(actors)


def _link(up: bool) -> Callable[[Chaos], None]:
    def run(ch: Chaos) -> None:
        ray.get(ch.trainer(1).wt_set_link.remote(up))
        if not up:
            _mark(ch)
    return run


def _budget(nbytes: int | None) -> Callable[[Chaos], None]:
    def run(ch: Chaos) -> None:
        ray.get(ch.trainer(_budget_rank(ch)).wt_fail_after_bytes.remote(nbytes))
        if nbytes is not None:
            _mark(ch)
    return run


def _budget_rank(ch: Chaos) -> int:
    """The rank whose NIC fails transiently: rank 2 of the demo's 4, the last of fewer."""
    return min(2, len(ch.fleet.trainers) - 1)


def _continue_engine(ch: Chaos) -> None:
    os.kill(ch.pid, signal.SIGCONT)


FAULTS: dict[str, Fault] = {
    "engine-killed-before": Fault(before=_kill_engine, names=lambda ch: [VICTIM],
                                  recover=_new_replica, recovery="add_replica, next update"),
    "engine-killed-during": Fault(during=_kill_engine, names=lambda ch: [VICTIM],
                                  recover=_new_replica, recovery="add_replica, next update"),
    "engine-stopped-before": Fault(
        before=_stop_engine_now, after=_continue_engine, names=lambda ch: [f"{VICTIM}/tp1"],
        recover=lambda ch: ch.ctl.resync(VICTIM), recovery="SIGCONT, resync, next update"),
    "engine-stopped-during": Fault(
        before=_remember_pid, during=_stop_engine, after=_continue_engine,
        names=lambda ch: [f"{VICTIM}/tp1"], recover=lambda ch: ch.ctl.resync(VICTIM),
        recovery="SIGCONT, resync, next update"),
    "region-revoked": Fault(before=_revoke_region, names=lambda ch: [VICTIM, "deregistered"],
                            recover=lambda ch: ch.ctl.setup(), recovery="setup(), next update"),
    "trainer-killed-during": Fault(during=_kill_trainer, names=lambda ch: ["trainer rank 1"],
                                   recover=_replace_trainers,
                                   recovery="new trainers, setup(trainers=), next update"),
    "nic-link-down": Fault(before=_link(False), after=_link(True),
                           names=lambda ch: ["trainer rank 1"]),
    "nic-transient-error": Fault(before=_budget(256 << 10), after=_budget(None),
                                 names=lambda ch: [f"trainer rank {_budget_rank(ch)}"],
                                 may_succeed=True),
}


# ------------------------------------------------------------------------ running them


def _during(ch: Chaos, inject: Callable[[Chaos], None]) -> None:
    def hook(phase: str, done: int, total: int) -> None:
        if phase == "transfer" and done == 0:
            ch.ctl.progress = None
            inject(ch)
    ch.ctl.progress = hook


def _judge(ch: Chaos, fault: Fault, err: Exception | None, took: float) -> tuple[bool, str, list]:
    """(ok, outcome, torn) of one faulty update."""
    from actors import UpdateError

    bound = ch.fleet.config.update_timeout_s + BOUND_MARGIN_S
    if err is None:
        return fault.may_succeed and took <= bound, "update succeeded (retried)", []
    if not isinstance(err, UpdateError):
        return False, f"{type(err).__name__}: {err}".splitlines()[0], []
    missing = [n for n in fault.names(ch) if n not in str(err)]
    held = [n for n in err.torn if n in ch.ctl.replicas and n not in err.resynced]
    bad = [n for n in held if not ch.held(n)]
    others = [n for n, v in ch.ctl.weights_version().items()
              if n not in err.torn and v != err.version]
    ok = not missing and not bad and not others and took <= bound
    outcome = (f"UpdateError naming {fault.names(ch)}" + (f", missing {missing}" if missing else "")
               + (f"; lost {err.lost}" if err.lost else "")
               + (f"; re-synced {err.resynced}" if err.resynced else "")
               + (f"; held {held}" if held else "")
               + (f"; NOT held {bad}" if bad else "") + (f"; stale {others}" if others else ""))
    return ok, outcome, list(err.torn)


def run_fault(ch: Chaos, name: str, fault: Fault) -> ChaosRow:
    ch.train()
    ch.version += 1
    if fault.before is not None:
        fault.before(ch)
    if fault.during is not None:
        _during(ch, fault.during)
    probe = ServingProbe(ch.fleet) if ch.apply == "shadow" else contextlib.nullcontext()
    with probe:
        start, err = time.monotonic(), None
        ch.injected_at = ch.injected_at if fault.before is not None else start
        try:
            ch.ctl.update(ch.version)
        except Exception as exc:  # judged below: the kind of error is part of the outcome
            err = exc
        end = time.monotonic()
    ch.ctl.progress = None
    if fault.after is not None:
        fault.after(ch)
    ok, outcome, torn = (judge_shadow(ch, fault, err, end - start, probe)
                         if ch.apply == "shadow" else _judge(ch, fault, err, end - start))
    problems = []
    try:
        fault.recover(ch)
        problems = ch.verified_update()
    except Exception as exc:  # a failed recovery is a row that did not heal, not a crash
        problems = [f"recovery: {type(exc).__name__}: {exc}"]
    return ChaosRow(fault=name, ok=ok, detect_s=round(end - ch.injected_at, 3), healed=not problems,
                    outcome=outcome, torn=torn, recovery=fault.recovery, problems=problems)


def run_faults(fleet: Fleet, names: list[str], console: Console) -> list[ChaosRow]:
    ch, rows = Chaos(fleet), []
    problems = ch.verified_update()  # a healthy start: the version every fault starts from
    if problems:
        raise RuntimeError(f"wt chaos: the cluster is not healthy before any fault: {problems}")
    for name in names:
        console.print(f"fault [bold]{name}[/] ...")
        row = run_fault(ch, name, FAULTS[name])
        rows.append(row)
        for p in row.problems:
            console.print(f"  [red]{p}[/]")
    return rows


def render(rows: list[ChaosRow]) -> Table:
    table = Table(title="wt chaos")
    for col in ("fault", "ok", "outcome", "detect s", "replicas torn", "recovery", "healed"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.fault, "[green]yes[/]" if r.ok else "[red]no[/]", r.outcome,
                      f"{r.detect_s:.2f}", ", ".join(r.torn) or "-", r.recovery,
                      "[green]yes[/]" if r.healed else "[red]no[/]")
    return table


def run(*, config: Path, faults: str | None, update_timeout_s: float, nic_gbps: float,
        json_path: Path | None, fleet: Fleet | None = None, apply: str = "in_place") -> int:
    """``wt chaos``; ``fleet``: run on these actors (tests) instead of starting the demo's;
    ``apply``: ``shadow`` judges each fault as a transaction
    (:mod:`actors.tools.demo.chaos_shadow`)."""
    console = command_console(json_path)
    names = list(FAULTS) if not faults else [f.strip() for f in faults.split(",") if f.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        console.print(f"[bold red]error:[/] unknown faults {unknown}; known: {list(FAULTS)}")
        return 2
    run_cfg: RunConfig = load_run_config(config)
    with fleet_session(run_cfg, fleet, update_timeout_s=update_timeout_s, nic_gbps=nic_gbps,
                       actor_classes=FAULTY_ACTORS, apply=apply) as active:
        rows = run_faults(active, names, console)
    console.print(render(rows))
    if json_path is not None:
        emit_json(str(json_path) if json_to_stdout(json_path) else json_path,
                  [r.as_dict() for r in rows], console)
    good = all(r.ok and r.healed for r in rows)
    console.print("[green]every fault ended cleanly and healed[/]" if good
                  else "[bold red]some faults did not end cleanly or did not heal[/]")
    return 0 if good else 1
