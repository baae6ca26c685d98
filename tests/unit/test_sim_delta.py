"""The simulator with sparse deltas (scheduling.sim.delta): bytes on the wire per piece as
the sender decides them, and a delta update never predicted slower on the NICs than dense."""

from __future__ import annotations

import numpy as np
import pytest

from actors.tools.cli.plan_cmd import build
from scheduling.sim.delta import piece_wire_bytes, simulate_delta
from scheduling.sim.simulate import simulate
from weight_transfer.delta.codec import RECORD, Encoding, encoded_size


@pytest.fixture(scope="module")
def built():
    return build("configs/models/tiny_llama.yaml", "configs/clusters/local_cpu.yaml",
                 expert_naming="per_expert", gather_order="interleaved", validate=False)


def test_wire_bytes_follow_the_encoding(built):
    plan = built.plan
    dense = np.array([p.nbytes for p in plan.pieces], dtype=np.float64)
    assert np.array_equal(piece_wire_bytes(plan, 1.0), dense)  # all changed: dense
    zero = piece_wire_bytes(plan, 0.0)
    assert (zero < dense).all() and (zero >= RECORD.size).all()
    p = max(plan.pieces, key=lambda q: q.nbytes)
    n = p.nbytes // 2  # bf16 engine
    k = round(0.004 * n)
    want = RECORD.size + encoded_size(Encoding.SPARSE, n, k, 2)
    assert piece_wire_bytes(plan, 0.004)[plan.pieces.index(p)] == want
    with pytest.raises(ValueError, match="fraction"):
        piece_wire_bytes(plan, 1.5)


def test_delta_prediction_has_a_lower_nic_bound(built):
    dense = simulate(built.plan, built.cluster)
    sparse = simulate_delta(built.plan, built.cluster, 0.004)
    assert sparse.lower_bound_seconds < dense.lower_bound_seconds / 10
    assert sparse.nic_seconds < dense.nic_seconds
    assert "apply" in sparse.stage_seconds
    full = simulate_delta(built.plan, built.cluster, 1.0)
    assert full.lower_bound_seconds == pytest.approx(dense.lower_bound_seconds)
