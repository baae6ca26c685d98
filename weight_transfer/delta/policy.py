"""When a delta update pays: the time-based fallback of a trainer rank's sparse deltas.

Deltas always put fewer bytes on the wire, but they cost CPU the dense update
does not spend (the diff and encode on the trainer, the in-place apply on the
engine at finish). On a fast link, or a starved CPU, that costs more than the
bytes it saves. So before each non-anchor update every trainer rank compares,
from rates measured in its earlier updates, what its share of the update costs
each way::

    t_delta = P * r_encode + W * r_apply + F_rank + F_update   # P: its pieces (each diffed
    t_dense = W / r_nic + F_dense + F_update   # once), W: the bytes its tasks write (dense,
                                               # or records' ranges)

* ``r_encode``: CPU seconds (of the encoding thread) of its diff + encode per
  piece diffed: set by an update that diffed most pieces, blended
  (:data:`SMOOTH`) with a probe's sample; per piece, not per byte, so that a
  sample of pieces estimates the whole update without bias whatever the mix of
  piece sizes (a per-byte rate of small pieces is mostly fixed cost), and CPU,
  not wall, time: a probe runs beside a dense update's quantization, whose
  contention a delta update (which does not quantize whole pieces) does not have;
* ``r_apply``: the engines' apply seconds per destination byte their records
  covered (two digests of every range and the scatter: per byte; summed over
  engine ranks, a conservative serial estimate), measured by the controller
  (set by a round with most records, blended from a probe's) and handed over
  in the directive;
* ``r_nic``: this rank's dense write rate, its dense bytes over the time its
  dense writes were in flight (the union of the write intervals);
* ``F_rank``: the fixed cost of the rank's delta run that the encode rate does not
  see (the FP8 source diff, prepare, the pipeline, the records' WRITEs and headers,
  the barrier: its run's wall less its encode CPU), measured on the rank after an
  update that diffed most pieces;
* ``F_dense``: the same for a dense run (its wall less the time its dense writes
  were in flight), measured after an update that wrote most bytes dense (an anchor);
* ``F_update``: the controller's part of a delta update outside the trainers' runs
  and the apply (the directive, pause, fence, integrity check, resume: the update's
  seconds less the slowest rank's run and the apply fan-out), measured by the
  controller and handed over in the directive (``fixed_s``); a dense update pays
  it too (pause, check, resume), so both estimates hold it.

With both fixed parts the delta estimate is the update's seconds as measured
(``wt bench delta`` prints them side by side), not only the cost that grows with
the pieces and bytes.

The rank writes deltas when ``t_delta <= t_dense``, else every piece dense
(``dense_time``) except a rotating :data:`PROBE_SHARE` of its pieces, which
still go as deltas so that ``r_encode`` and ``r_apply`` stay measured (a change
of load or learning rate flips the decision back). With a rate still unknown
(no dense writes yet, or no delta measured yet) the update probes: only the
probe share goes as deltas. The rule is per rank and per update; the
estimates and the reason land in the rank's
:class:`~weight_transfer.sender.delta.send.DeltaStats` (``fallback``, ``est_delta_s``,
``est_dense_s``)::

    rates = DeltaRates()                         # kept across plans by the trainer
    choice = rates.choose(pieces=P, written=W, apply_s_per_byte=r, turn=7, fixed_s=F_update)
    choice.delta, choice.reason, choice.probe(piece_index)
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTH = 0.5  # weight of the newest measurement in each moving average
PROBE_SHARE = 16  # one piece in this many goes as a delta while the rank sends dense


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTH) * old + SMOOTH * new


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (overlapping writes count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """One rank's decision for one update."""

    delta: bool  # every piece as a delta (False: dense, but for the probes)
    reason: str
    est_delta_s: float | None = None
    est_dense_s: float | None = None
    fixed_s: float | None = None  # of est_delta_s: F_rank + F_update
    turn: int = 0

    def probe(self, index: int) -> bool:
        """Whether the rank's ``index``-th piece goes as a delta anyway (a probe)."""
        return (index + self.turn) % PROBE_SHARE == 0


@dataclass(slots=True)
class DeltaRates:
    """The measured rates of one trainer rank (see the module docstring)."""

    encode_s_per_piece: float | None = None
    nic_bytes_per_s: float | None = None
    fixed_s: float | None = None  # F_rank
    dense_fixed_s: float | None = None  # F_dense
    history: list[str] = field(default_factory=list)

    def measured_encode(self, seconds: float, pieces: int, whole: bool = False) -> None:
        """``seconds`` of CPU for ``pieces`` diffed; ``whole``: most of an update's pieces
        (it replaces the rate; a probe's sample is blended in)."""
        if pieces > 0:
            old = None if whole else self.encode_s_per_piece
            self.encode_s_per_piece = _blend(old, seconds / pieces)

    def measured_fixed(self, run_seconds: float, encode_seconds: float) -> None:
        """A delta run (most pieces diffed) of ``run_seconds`` wall whose encode took
        ``encode_seconds`` of CPU: its fixed cost ``F_rank``, blended in."""
        self.fixed_s = _blend(self.fixed_s, max(0.0, run_seconds - encode_seconds))

    def measured_dense_fixed(self, run_seconds: float, write_seconds: float) -> None:
        """A dense run of ``run_seconds`` wall whose writes were in flight
        ``write_seconds``: its fixed cost ``F_dense``, blended in."""
        self.dense_fixed_s = _blend(self.dense_fixed_s, max(0.0, run_seconds - write_seconds))

    def measured_dense(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.nic_bytes_per_s = _blend(self.nic_bytes_per_s, nbytes / seconds)

    def choose(self, *, pieces: int, written: int, apply_s_per_byte: float | None,
               turn: int, fixed_s: float | None = None) -> Choice:
        """Deltas or dense for an update of ``pieces`` to diff whose tasks write ``written``
        bytes (``fixed_s``: the controller's fixed part of a delta update, ``F_update``;
        None: not measured yet, counted as 0)."""
        enc, nic = self.encode_s_per_piece, self.nic_bytes_per_s
        if nic is None:
            return Choice(delta=False, turn=turn,
                          reason="probe: no dense write rate measured yet")
        dense_s = written / nic + (self.dense_fixed_s or 0.0) + (fixed_s or 0.0)
        if enc is None or apply_s_per_byte is None:
            return Choice(delta=False, turn=turn, est_dense_s=dense_s,
                          reason="probe: no delta rates measured yet")
        fixed = (self.fixed_s or 0.0) + (fixed_s or 0.0)
        delta_s = pieces * enc + written * apply_s_per_byte + fixed
        part = f"delta est {delta_s:.3f} s (fixed {fixed:.3f} s)"
        if delta_s <= dense_s:
            return Choice(delta=True, turn=turn, est_delta_s=delta_s, est_dense_s=dense_s,
                          fixed_s=fixed, reason=f"{part} <= dense est {dense_s:.3f} s")
        return Choice(delta=False, turn=turn, est_delta_s=delta_s, est_dense_s=dense_s,
                      fixed_s=fixed, reason=f"dense_time: {part} > dense est {dense_s:.3f} s")
