"""``wt chaos --apply shadow``: every fault of ``wt chaos`` with shadow weights, judged as
transactions.

In shadow mode a failed transfer never touches live memory, so a fault must leave
no replica torn: after each faulty update every replica still in the plan serves
(is not paused) a complete version that it reports, byte for byte the version's
weights as they were when that version was verified (the engines' digests are
kept per version); the next update (after the fault's recovery) heals, as in
place; and a client generating on the replica the faults spare throughout the
faulty update never waits longer than one flip: the longest time inside the update
with no engine step starting (a wait that began before the update counts only from its
start) stays within :data:`WAIT_BOUND_STEPS` of its own median step gap
(at least :data:`WAIT_BOUND_MIN_S`, or :data:`WAIT_BOUND_UPDATE_SHARE` of the update), while
in place it would wait the whole update;
the engine's own pause (its flip, from the step boundary to going on) is printed
beside it.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from actors.tools.bench.stall.bench import Clients, ReferenceClient, idle_gap, wait_within
from actors.tools.demo.verify import _engine_digests, _trainer_digests, first_answer
from weight_transfer.types import EngineRankId

SPARED = "engine0"  # the replica no engine fault hits (chaos.VICTIM is engine1)
# A client's longest wait: one flip and the step it waits for, on this 2-core machine shared
# with other jobs, where a process may not run for a few hundred ms: this many of its
# median step gaps, at least WAIT_BOUND_MIN_S, or, where the machine is so loaded that one
# step takes longer, WAIT_BOUND_UPDATE_SHARE of the update. In place the same client waits
# the whole update (seconds here, with the capped NICs), so every bound still tells the two
# apart; none depends on how fast this machine is.
WAIT_BOUND_STEPS = 8.0
WAIT_BOUND_MIN_S = 0.5
WAIT_BOUND_UPDATE_SHARE = 0.5


class ServingProbe:
    """A client generating on the spared replica during one update; its longest wait."""

    def __init__(self, fleet: Any) -> None:
        self.client = ReferenceClient(fleet)
        self.clients: Clients | None = None
        self.since = self.start = self.end = 0.0

    def __enter__(self) -> ServingProbe:
        self.since = time.time()
        self.clients = Clients(self.client, [SPARED]).__enter__()
        time.sleep(0.5)  # a few steps before the update
        self.start = time.time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = time.time()
        time.sleep(0.3)  # the steps after it
        self.clients.__exit__(*exc)

    def verdict(self) -> tuple[bool, str]:
        steps = self.client.step_times(SPARED, self.since)
        wait = wait_within(steps, self.start, self.end)
        gap = idle_gap(steps, [(self.start, self.end)])
        bound = max(WAIT_BOUND_MIN_S, WAIT_BOUND_STEPS * gap,
                    WAIT_BOUND_UPDATE_SHARE * (self.end - self.start))
        flips = ray.get([a.wt_shadow_info.remote() for a in self.client.replicas[SPARED]],
                        timeout=60)
        flip = max(i.last_flip_s for i in flips)
        return wait <= bound and not self.clients.errors, (
            f"client on {SPARED}: longest wait {wait * 1e3:.0f} ms (bound {bound * 1e3:.0f} ms, "
            f"update {self.end - self.start:.2f} s, engine flip {flip * 1e3:.1f} ms)"
            + (f"; {self.clients.errors}" if self.clients.errors else ""))


def digests(fleet: Any, names: list[str]) -> dict[str, dict[str, str]]:
    """``{"engine0/tp1": {tensor: digest}}`` of what the ranks of ``names`` serve now."""
    return {str(EngineRankId(replica=n, rank=r)): d for n in names
            for r, d in enumerate(ray.get([a.__ray_call__.remote(_engine_digests)
                                           for a in fleet.replicas[n]], timeout=60))}


def new_version_digests(ch: Any) -> dict[str, dict[str, str]] | None:
    """The digests every engine rank must hold at ``ch.version`` (the trainers' current
    weights: the faulty update's); None where the trainers cannot say (one died)."""
    try:
        return first_answer(ray.get(
            [t.__ray_call__.remote(_trainer_digests, ch.fleet.engine_keys,
                                   ch.fleet.config.engine_fp8) for t in ch.fleet.trainers],
            timeout=120))
    except (ray.exceptions.RayError, TimeoutError, StopIteration):
        return None


def serving_problems(ch: Any, kept: dict[int, dict[str, dict[str, str]]]) -> list[str]:
    """Every replica in the plan serves a complete version it reports: not paused, every
    rank reporting the controller's version, its bytes that version's (``kept``: digests
    per version, recorded when each version was verified)."""
    problems = []
    versions = ch.ctl.weights_version()
    names = [n for n in ch.ctl.replicas if n in ch.fleet.replicas]
    for name in names:
        want = versions[name]
        try:
            state = ch.serving(name)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            problems.append(f"{name}: does not answer: {type(exc).__name__}")
            continue
        if state != [(False, want)] * len(state):
            problems.append(f"{name}: (paused, version) per rank {state}, controller says {want}")
            continue
        if want not in kept and want == ch.version:  # the faulty update's version
            fresh = new_version_digests(ch)
            if fresh is not None:
                kept[want] = fresh
        if want not in kept:
            problems.append(f"{name}: serves version {want}, whose bytes are not known")
            continue
        got = digests(ch.fleet, [name])
        bad = sorted(k for k, d in got.items() if d != kept[want].get(k))
        if bad:
            problems.append(f"{name}: ranks {bad} do not hold version {want} completely")
    return problems


def judge_shadow(ch: Any, fault: Any, err: Exception | None, took: float,
                 probe: ServingProbe) -> tuple[bool, str, list]:
    """(ok, outcome, torn) of one faulty update in shadow mode (module docstring)."""
    from actors import UpdateError

    bound = ch.fleet.config.update_timeout_s + 30.0
    waited_ok, waited = probe.verdict()
    problems = serving_problems(ch, ch.kept)
    if err is None:
        ok = fault.may_succeed and took <= bound and waited_ok and not problems
        return ok, f"update succeeded (retried); {waited}", []
    if not isinstance(err, UpdateError):
        return False, f"{type(err).__name__}: {err}".splitlines()[0], []
    missing = [n for n in fault.names(ch) if n not in str(err)]
    torn = [n for n in err.torn if n not in err.lost]
    ok = not missing and not torn and not problems and waited_ok and took <= bound
    outcome = (f"UpdateError naming {fault.names(ch)}" + (f", missing {missing}" if missing else "")
               + (f"; lost {err.lost}" if err.lost else "")
               + (f"; kept {err.kept}" if getattr(err, "kept", None) else "")
               + (f"; TORN {torn}" if torn else "") + f"; {waited}"
               + "".join(f"; {p}" for p in problems))
    return ok, outcome, torn
