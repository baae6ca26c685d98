"""The simulator with sparse deltas: only the changed elements of each piece on the wire.

``simulate_delta(plan, cluster, fraction)`` predicts an update where a share
``fraction`` of every piece's elements changed since the last update: each
piece puts the bytes of its smallest encoding on the wire
(:func:`weight_transfer.delta.codec.encoded_size` plus its record header), or
itself when that is not smaller, exactly as
:class:`~weight_transfer.sender.delta.send.DeltaSender` decides. Everything before the
NIC is as dense (the same gathers, the same quantization) plus the diff and
encode of every piece (``sim.delta_diff_gbps`` of its engine bytes per trainer
rank); after the transfer every engine rank applies what it received in place
(``sim.delta_apply_gbps`` of its dense bytes: two digests and a scatter), a stage
of its own before the resume::

    r = simulate_delta(plan, cluster, 0.004)     # FP8 at lr 1e-6, measured
    r.seconds, r.lower_bound_seconds, r.binding, r.stage_seconds["apply"]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from scheduling.plan import Plan
from scheduling.sim.simulate import (
    SimResult,
    _simulate_nics,
    bound_nics,
    lower_bounds,
    with_piece_bytes,
    with_stages,
)
from weight_transfer.delta.codec import RECORD, choose, encoded_size
from weight_transfer.types import dtype_size


def piece_wire_bytes(plan: Plan, fraction: float) -> np.ndarray:
    """Bytes each piece puts on the wire when ``fraction`` of its elements changed."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"delta fraction must be in [0, 1], not {fraction}")
    out = np.zeros(len(plan.pieces))
    sizes: dict[str, int] = {}
    for i, p in enumerate(plan.pieces):
        s = sizes.setdefault(p.dst_dtype, dtype_size(p.dst_dtype))
        n = p.nbytes // s
        k = round(fraction * n)
        enc = RECORD.size + encoded_size(choose(n, k, s), n, k, s)
        out[i] = min(enc, p.nbytes)
    return out


def simulate_delta(plan: Plan, cluster, fraction: float, *, max_inflight: int | None = None,
                   resolution: float = 1e-5, nic_model: str = "events") -> SimResult:
    """Predicted seconds of a delta update (see the module docstring); ``lower_bound_seconds``
    is the NIC bound of the delta's bytes."""
    inflight = max_inflight or cluster.sim.max_inflight
    wire = piece_wire_bytes(plan, fraction)
    sparse = with_piece_bytes(plan, wire)
    nic = bound_nics(sparse, cluster) if nic_model == "bound" else _simulate_nics(
        sparse, cluster, inflight, resolution, 4, False)
    sim = cluster.sim
    dense = np.fromiter((p.nbytes for p in plan.pieces), np.float64, len(plan.pieces))
    extra = dense / (sim.delta_diff_gbps * 1e9) if sim.delta_diff_gbps else None
    res = with_stages(plan, cluster, nic, inflight=inflight, write_latency=nic_model == "bound",
                      wire=wire, extra_prepare=extra)
    apply_s = 0.0
    if sim.delta_apply_gbps:
        recv = plan.recv_bytes().sum(axis=0)  # dense bytes per engine NIC
        apply_s = float(recv.max(initial=0.0)) / (sim.delta_apply_gbps * 1e9)
    stages = {**res.stage_seconds, "apply": apply_s}
    total_lb, _ = lower_bounds(sparse, cluster)
    binding = "apply" if apply_s > max(res.stage_seconds.values(), default=0.0) else res.binding
    return dataclasses.replace(res, seconds=res.seconds + apply_s, stage_seconds=stages,
                               binding=binding, lower_bound_seconds=total_lb)
