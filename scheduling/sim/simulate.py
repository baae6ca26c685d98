"""A discrete-event model of executing a plan: predicted seconds and NIC busy time.

The model, per mesh group (groups run one after the other, a barrier between):

* every trainer rank runs its tasks of the group in plan order, at most
  ``max_inflight`` at a time; a task starts as soon as one of its slots frees;
* a running write occupies its sender NIC and its receiver NIC; bandwidth is
  shared between the writes on a NIC by progressive filling (max-min fairness,
  ``fill_rounds`` rounds of water-filling: 1 round = equal split with each
  flow capped by its tighter NIC, more rounds hand unused capacity to flows
  that can take it);
* a write costs ``write_latency_us`` of sender time on top of its bytes (a
  per-message overhead, as the *o* of LogGP).

Events are completions. Completions within ``resolution`` x (the group's lower
bound) of the earliest one are processed together at the latest of them, so the
prediction errs on the slow side by at most that much per event - this keeps a
million-task plan to about a hundred thousand events::

    result = simulate(plan, cluster)
    result.seconds, result.lower_bound_seconds, result.per_nic_busy_seconds
    simulate(plan, cluster, record=True).task_start   # per task, for a timeline

Around the NIC model, :mod:`scheduling.sim.stages` replays what the executor
does per rank and parameter (watermark, h2d, gather, prepare, FIFO writes at
the rate the NIC model found, a barrier per group) with the costs of the
cluster's ``sim:`` section; ``stage_seconds`` is each stage's busy time on the
critical rank and ``binding`` the stage that took most of it (``group_binding``:
the same per group). With every stage
cost unset (the default) the prediction is the NIC model's. On a CPU-only host
(``cpu_cores`` set) every rank's CPU work shares the cores: a group takes at
least the sum of that work / the cores (:func:`cpu_floor`; ``binding`` is then
``"cpu"``). ``nic_model="bound"``
skips the discrete-event NIC model and lets each group's NICs take their lower
bound (fast, for sweeps).

``piece_scale`` (a factor per piece of ``plan.pieces``, or one for all)
scales the bytes each piece puts on the wire before anything is simulated
(:func:`with_piece_bytes`): a sparse delta's encoded size, for example; the
prepare costs follow the scaled bytes too.

``lower_bound_seconds`` is the issue's bound, max over NICs of bytes /
bandwidth; ``barrier_lower_bound_seconds`` sums that bound per group, which is
what any execution with barriers between groups must take at least.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scheduling.cluster.config import ClusterConfig
    from scheduling.plan import Plan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """Outcome of :func:`simulate`; times in seconds."""

    seconds: float
    lower_bound_seconds: float
    barrier_lower_bound_seconds: float
    group_seconds: tuple[float, ...]
    group_lower_bounds: tuple[float, ...]
    per_nic_busy_seconds: dict[str, float] = field(hash=False)
    events: int
    nic_seconds: float = 0.0  # the NIC model alone (sum over groups)
    stage_seconds: dict[str, float] = field(default_factory=dict, hash=False)
    binding: str = "write"
    group_binding: tuple[str, ...] = ()  # per group: the critical rank's busiest stage, or cpu
    # With record=True: when each task (plan row) started and ended, seconds from the start.
    task_start: np.ndarray | None = field(default=None, hash=False, repr=False, compare=False)
    task_end: np.ndarray | None = field(default=None, hash=False, repr=False, compare=False)

    @property
    def efficiency(self) -> float:
        """Lower bound / predicted time (1.0 = every byte at line rate on the busiest NIC)."""
        return self.lower_bound_seconds / self.seconds if self.seconds > 0 else 1.0


def lower_bounds(plan: Plan, cluster: ClusterConfig) -> tuple[float, np.ndarray]:
    """(max over NICs of all bytes / bandwidth, the same per group)."""
    send = plan.send_bytes() / cluster.send_bytes_per_s
    recv = plan.recv_bytes() / cluster.recv_bytes_per_s
    total = max(send.sum(axis=0).max(initial=0.0), recv.sum(axis=0).max(initial=0.0))
    per_group = np.maximum(send.max(axis=1, initial=0.0), recv.max(axis=1, initial=0.0))
    return float(total), per_group


@dataclass(slots=True)
class _Flows:
    """Slot arrays: slot ``k`` belongs to trainer ``k // inflight``."""

    rem: np.ndarray
    snd: np.ndarray
    rcv: np.ndarray
    live: np.ndarray
    task: np.ndarray  # plan row of the task in each slot


def _rates(s: np.ndarray, r: np.ndarray, cap_s: np.ndarray, cap_r: np.ndarray, rounds: int):
    """Progressive filling of flows (sender NIC ``s``, receiver NIC ``r``)."""
    rate = np.zeros(len(s))
    left_s, left_r = cap_s.copy(), cap_r.copy()
    active = np.ones(len(s), dtype=bool)
    for _ in range(rounds):
        ns = np.bincount(s[active], minlength=len(cap_s))
        nr = np.bincount(r[active], minlength=len(cap_r))
        share = np.minimum((left_s / np.maximum(ns, 1))[s], (left_r / np.maximum(nr, 1))[r])
        inc = np.where(active, share, 0.0)
        rate += inc
        left_s -= np.bincount(s, inc, minlength=len(cap_s))
        left_r -= np.bincount(r, inc, minlength=len(cap_r))
        active &= (left_s > cap_s * 1e-9)[s] & (left_r > cap_r * 1e-9)[r]
        if not active.any():
            break
    return rate


def _refill(done: np.ndarray, flows: _Flows, cursor, end, tasks, inflight: int,
            now: float = 0.0, times: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Start the next tasks of the trainers whose slots in ``done`` just freed."""
    trainer = done // inflight
    order = np.argsort(trainer, kind="stable")
    done, trainer = done[order], trainer[order]
    first = np.concatenate(([True], trainer[1:] != trainer[:-1]))
    starts = np.flatnonzero(first)
    within = np.arange(len(done)) - np.repeat(starts, np.diff(np.append(starts, len(done))))
    idx = cursor[trainer] + within
    ok = idx < end[trainer]
    slots, idx = done[ok], idx[ok]
    nbytes, snd, rcv = tasks
    flows.rem[slots], flows.snd[slots], flows.rcv[slots] = nbytes[idx], snd[idx], rcv[idx]
    flows.live[slots] = True
    flows.task[slots] = idx
    if times is not None:
        times[0][idx] = now
    cursor += np.bincount(trainer[ok], minlength=len(cursor))


def _run_group(tasks, cursor, end, caps, inflight: int, delta: float, rounds: int,
               times: tuple[np.ndarray, np.ndarray] | None = None, offset: float = 0.0):
    """Simulate one group; returns (seconds, sender busy, receiver busy, events).

    With ``times`` (start, end arrays over the plan's tasks), each task's times
    are written there, ``offset`` added (the group's start).
    """
    cap_s, cap_r = caps
    n_slots = len(cursor) * inflight
    flows = _Flows(
        rem=np.zeros(n_slots),
        snd=np.zeros(n_slots, dtype=np.int64),
        rcv=np.zeros(n_slots, dtype=np.int64),
        live=np.zeros(n_slots, dtype=bool),
        task=np.zeros(n_slots, dtype=np.int64),
    )
    busy_s, busy_r = np.zeros(len(cap_s)), np.zeros(len(cap_r))
    _refill(np.arange(n_slots), flows, cursor, end, tasks, inflight, offset, times)
    now, events = 0.0, 0
    while True:
        li = np.flatnonzero(flows.live)
        if len(li) == 0:
            return now, busy_s, busy_r, events
        s, r = flows.snd[li], flows.rcv[li]
        rate = _rates(s, r, cap_s, cap_r, rounds)
        finish = flows.rem[li] / rate
        soonest = finish.min()
        window = finish <= soonest + delta
        dt = finish[window].max()
        flows.rem[li] = np.maximum(flows.rem[li] - rate * dt, 0.0)
        busy_s[np.unique(s)] += dt
        busy_r[np.unique(r)] += dt
        now += dt
        done = li[window]
        flows.live[done] = False
        if times is not None:
            times[1][flows.task[done]] = offset + now
        _refill(done, flows, cursor, end, tasks, inflight, offset + now, times)
        events += 1


def simulate(
    plan: Plan,
    cluster: ClusterConfig,
    *,
    max_inflight: int | None = None,
    resolution: float = 1e-5,
    fill_rounds: int = 4,
    record: bool = False,
    nic_model: str = "events",
    piece_scale: np.ndarray | float | None = None,
) -> SimResult:
    """Predict the execution time of ``plan`` on ``cluster`` (see the module docstring)."""
    if piece_scale is not None:
        scale = np.asarray(piece_scale, dtype=np.float64)
        if scale.ndim and scale.shape != (len(plan.pieces),):
            raise ValueError(f"piece bytes: piece_scale needs one factor or one per piece "
                             f"({len(plan.pieces)}), got shape {scale.shape}")
        sizes = np.fromiter((p.nbytes for p in plan.pieces), np.float64, len(plan.pieces))
        plan = with_piece_bytes(plan, np.round(scale * sizes))
    inflight = max_inflight or cluster.sim.max_inflight
    if inflight < 1 or fill_rounds < 1 or resolution < 0:
        raise ValueError("max_inflight and fill_rounds must be >= 1, resolution >= 0")
    if nic_model not in ("events", "bound"):
        raise ValueError(f"nic_model must be 'events' or 'bound', not {nic_model!r}")
    if nic_model == "bound":
        nic = bound_nics(plan, cluster)
    else:
        nic = _simulate_nics(plan, cluster, inflight, resolution, fill_rounds, record)
    # The event model already charges write_latency_us; the bound does not.
    return with_stages(plan, cluster, nic, inflight=inflight, record=record,
                       write_latency=nic_model == "bound")


def bound_nics(plan: Plan, cluster: ClusterConfig) -> SimResult:
    """Each group's NICs at their lower bound (``nic_model="bound"``)."""
    total_lb, group_lb = lower_bounds(plan, cluster)
    busy = dict(zip(plan.send_nics, (plan.send_bytes().sum(axis=0)
                                     / cluster.send_bytes_per_s).tolist(), strict=True))
    busy.update(zip(plan.recv_nics, (plan.recv_bytes().sum(axis=0)
                                     / cluster.recv_bytes_per_s).tolist(), strict=True))
    nic = SimResult(seconds=float(group_lb.sum()), lower_bound_seconds=total_lb,
                    barrier_lower_bound_seconds=float(group_lb.sum()),
                    group_seconds=tuple(float(x) for x in group_lb),
                    group_lower_bounds=tuple(float(x) for x in group_lb),
                    per_nic_busy_seconds=busy, events=0)
    return nic


def with_piece_bytes(plan: Plan, nbytes: np.ndarray) -> Plan:
    """``plan`` with piece ``k`` putting ``nbytes[k]`` bytes on the wire (>= 0), for the
    simulator only: such a plan no longer validates (its pieces' sizes are not their
    rectangles'). Tasks, sources and order stay as they are."""
    import dataclasses

    nbytes = np.asarray(nbytes)
    if nbytes.shape != (len(plan.pieces),) or (nbytes < 0).any():
        raise ValueError(f"piece bytes: need {len(plan.pieces)} values >= 0, got shape "
                         f"{nbytes.shape}")
    pieces = tuple(p if int(n) == p.nbytes else dataclasses.replace(p, nbytes=int(n))
                   for p, n in zip(plan.pieces, nbytes.tolist(), strict=True))
    return dataclasses.replace(plan, pieces=pieces)


def _simulate_nics(plan: Plan, cluster: ClusterConfig, inflight: int, resolution: float,
                   fill_rounds: int, record: bool) -> SimResult:
    """The discrete-event model of the NICs alone."""
    total_lb, group_lb = lower_bounds(plan, cluster)
    send_bw, recv_bw = cluster.send_bytes_per_s, cluster.recv_bytes_per_s
    overhead = cluster.sim.write_latency_us * 1e-6 * send_bw
    # Sender-side overhead in bytes at line rate; the receiver sees it too (conservative).
    nbytes = plan.task_nbytes().astype(np.float64) + overhead
    tasks = (nbytes, plan.send_nic_of_task(), plan.recv_nic_of_task())
    caps = (np.full(len(plan.send_nics), send_bw), np.full(len(plan.recv_nics), recv_bw))
    n_tr = len(plan.trainer_ranks)
    key = plan.task_src.astype(np.int64) * plan.num_groups + plan.task_group
    busy_s, busy_r = np.zeros(len(plan.send_nics)), np.zeros(len(plan.recv_nics))
    group_s, events = [], 0
    times = (np.zeros(plan.num_tasks), np.zeros(plan.num_tasks)) if record else None
    for g in range(plan.num_groups):
        base = np.arange(n_tr, dtype=np.int64) * plan.num_groups + g
        cursor = np.searchsorted(key, base, side="left")
        end = np.searchsorted(key, base, side="right")
        delta = resolution * float(group_lb[g])
        secs, bs, br, ev = _run_group(tasks, cursor, end, caps, inflight, delta, fill_rounds,
                                      times, float(sum(group_s)))
        log.debug("simulate: group %d took %.4fs (bound %.4fs, %d events)", g, secs,
                  group_lb[g], ev)
        group_s.append(secs)
        busy_s += bs
        busy_r += br
        events += ev
    busy = dict(zip(plan.send_nics, busy_s.tolist(), strict=True))
    busy.update(zip(plan.recv_nics, busy_r.tolist(), strict=True))
    return SimResult(
        seconds=float(sum(group_s)),
        lower_bound_seconds=total_lb,
        barrier_lower_bound_seconds=float(group_lb.sum()),
        group_seconds=tuple(group_s),
        group_lower_bounds=tuple(float(x) for x in group_lb),
        per_nic_busy_seconds=busy,
        events=events,
        task_start=None if times is None else times[0],
        task_end=None if times is None else times[1],
    )


def with_stages(plan: Plan, cluster: ClusterConfig, nic: SimResult, *, inflight: int,
                record: bool = False, write_latency: bool = False,
                wire: np.ndarray | None = None,
                extra_prepare: np.ndarray | None = None) -> SimResult:
    """``nic`` (the NIC model's result) with the stages around the NICs added (``wire``,
    ``extra_prepare``: see :func:`scheduling.sim.stages.group_costs`)."""
    from scheduling.sim.stages import STAGES, group_costs, run_group

    sim = cluster.sim
    overhead = sim.write_latency_us * 1e-6 / inflight if write_latency else 0.0
    overhead += sim.write_overhead_us * 1e-6  # CPU time: not hidden by in-flight writes
    group_s, critical, cpu_bound = [], dict.fromkeys(STAGES, 0.0), False
    group_binding: list[str] = []
    start = np.zeros(plan.num_tasks) if record else None
    end = np.zeros(plan.num_tasks) if record else None
    for g, costs in enumerate(group_costs(plan, cluster, wire=wire,
                                          extra_prepare=extra_prepare)):
        total = costs.write_bytes.sum(axis=1)
        t_nic = nic.group_seconds[g]
        rate = min(cluster.send_bytes_per_s, total.max(initial=0.0) / t_nic) if t_nic > 0 \
            else np.inf
        times = run_group(costs, total / rate, watermark=sim.watermark_bytes,
                          write_overhead_s=overhead)
        # The NIC model stays a floor: its in-flight and fairness effects are not replayed.
        secs = max(times.seconds, t_nic)
        shared = cpu_floor(costs, times, sim)
        mine = dict.fromkeys(STAGES, 0.0)
        if len(costs.ranks):
            crit = int(np.argmax(times.write_end.max(axis=1)))
            mine = {st: float(times.busy[st][crit]) for st in STAGES}
            for st in STAGES:
                critical[st] += mine[st]
        group_binding.append(max(mine, key=mine.get) if any(mine.values()) else "write")
        if shared > secs:
            secs, cpu_bound = shared, True
            group_binding[-1] = "cpu"
        if record:
            _record(plan, g, costs, times, float(sum(group_s)), start, end)
        group_s.append(secs)
    binding = max(critical, key=critical.get) if any(critical.values()) else "write"
    binding = "cpu" if cpu_bound else binding
    seconds = float(sum(group_s))
    return SimResult(
        seconds=seconds, lower_bound_seconds=nic.lower_bound_seconds,
        barrier_lower_bound_seconds=nic.barrier_lower_bound_seconds,
        group_seconds=tuple(group_s), group_lower_bounds=nic.group_lower_bounds,
        per_nic_busy_seconds=nic.per_nic_busy_seconds, events=nic.events,
        nic_seconds=nic.seconds, stage_seconds=critical, binding=binding,
        group_binding=tuple(group_binding),
        task_start=start if record else nic.task_start,
        task_end=end if record else nic.task_end,
    )


def cpu_floor(costs, times, sim) -> float:
    """Seconds the group's CPU work needs on ``sim.cpu_cores`` shared cores (0: none set).

    On a CPU-only host the ranks' prepare work (cuts, FP8 quantization, the
    per-parameter overhead), their writes' fixed CPU cost and, with
    ``write_copy_gbps``, the copy of every written byte (a simnic WRITE is a
    memcpy) all run on the same cores: however well one rank overlaps them,
    the group takes at least the sum of that work over the ranks / the cores
    (processor sharing). On a GPU cluster (``cpu_cores`` unset) each rank
    computes on its own device and only the per-rank replay counts.
    """
    if sim.cpu_cores is None or not len(costs.ranks):
        return 0.0
    work = times.busy["prepare"].sum() + costs.write_count.sum() * sim.write_overhead_us * 1e-6
    if sim.write_copy_gbps is not None:
        work += costs.write_bytes.sum() / (sim.write_copy_gbps * 1e9)
    return float(work / sim.cpu_cores)


def _record(plan: Plan, g: int, costs, times, offset: float, start, end) -> None:
    """Each task of group ``g`` spans its parameter's write on its rank."""
    from scheduling.sim.stages import task_positions

    sel, row, pos = task_positions(plan, g, costs)
    start[sel] = offset + times.write_start[row, pos]
    end[sel] = offset + times.write_end[row, pos]
