"""A write into a serving replica after the resume is found, named and healed.

2 FSDP2 trainer ranks -> 2 replicas x TP2 (tiny_llama: the ``reference-fleet`` group's actors,
``tests/integration/conftest.py``), its controllers with integrity on. An
outsider (a plain Python process, ``outsider_write.py``: process_vm_writev, no Ray, nothing
of this project) inverts one byte of a serving replica's weights after the update resumed
it. In order:

1. integrity ``full`` (the trainers' checksums are the reference): ``ctl.check_integrity()``
   names the replica, rank, tensor and byte range, leaves one audit line, heals nothing;
   ``check_integrity(heal=True)`` re-syncs the replica from its peer (engine bytes equal the
   trainer's again), and the next check is clean;
2. integrity ``sample`` with the background check on (the engines hash their tensors for the
   reference, before the resume): a second outsider write is found by the background ticks,
   the peer is checked in full, and the replica is healed by a re-sync, with its audit
   lines and the mismatch counter; no tick runs while an update is in flight.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from actors import WeightTransferController
from actors.controller.audit import read_audit
from actors.tools.testkit.engine_bytes import engine_mismatches

OUTSIDER = Path(__file__).with_name("outsider_write.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
WAIT_S = 120.0  # the most the background check may take to heal (a bound, not a measure)


@pytest.fixture(scope="module")
def env(tmp_path_factory, reference_fleet):
    tmp = tmp_path_factory.mktemp("served")
    cfg = reference_fleet.config(integrity={"mode": "full"}, audit_path=tmp / "audit.jsonl")
    trainers, replicas = reference_fleet.trainers, reference_fleet.replicas
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    yield cfg, trainers, replicas, ctl
    ctl.shutdown()


def train(trainers, step):
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(step))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])


def stale(cfg, trainers, replica):
    """(rank, tensor) of ``replica`` whose bytes differ from the trainer's current weights."""
    return [(rank, name) for _, rank, name in engine_mismatches(cfg.model, trainers, [replica])]


def outsider_flip(actor, index, byte):
    """Invert ``byte`` of tensor ``index`` of an engine rank from another process; its name."""
    tensor = ray.get(actor.wt_engine_meta.remote()).tensors[index]
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    addr = tensor.region.addr + tensor.offset + byte
    out = subprocess.run([sys.executable, str(OUTSIDER), str(pid), hex(addr)], check=True,
                         capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    old, new = map(int, out.stdout.split())
    assert new == old ^ 0xFF
    return tensor.name


def test_a_full_check_names_an_outsider_write_after_the_resume(env):
    cfg, trainers, replicas, ctl = env
    train(trainers, 1)
    ctl.update(1)
    clean = ctl.check_integrity()
    assert clean.ok and clean.check.ranges == ctl.summary.num_tasks
    assert clean.check.bytes == ctl.summary.bytes_total  # every served byte
    name = outsider_flip(replicas[1][1], 3, 17)
    assert stale(cfg, trainers, replicas[1]) == [(1, name)]
    found = ctl.check_integrity()
    assert not found.ok and found.bad == ("engine1",) and found.healed == ()
    (m,) = found.check.mismatches
    assert (m.replica, m.rank, m.tensor) == ("engine1", 1, name)
    assert m.tensor_offset <= 17 < m.tensor_offset + m.length and m.actual != m.expected
    assert f"engine1/tp1 tensor '{name}' bytes [{m.tensor_offset}, " in found.check.message()
    assert ctl.weights_version() == {"engine0": 1, "engine1": 1}  # reported, not acted on
    line = read_audit(cfg.audit_path)[-1]
    assert line["kind"] == "check" and line["mode"] == "full" and line["bad"] == ["engine1"]
    assert line["integrity"]["mismatches"] == [m.describe()]


def test_a_full_check_with_heal_resyncs_the_replica_from_its_peer(env):
    cfg, trainers, replicas, ctl = env
    healed = ctl.check_integrity(heal=True)
    assert healed.bad == ("engine1",) and healed.healed == ("engine1",) and healed.held == ()
    assert stale(cfg, trainers, replicas[1]) == [] and stale(cfg, trainers, replicas[0]) == []
    assert ctl.weights_version() == {"engine0": 1, "engine1": 1}
    assert not any(ray.get([a.wt_paused.remote() for a in replicas[1]]))
    lines = read_audit(cfg.audit_path)[-2:]
    assert [x["kind"] for x in lines] == ["resync", "check"]
    assert lines[0]["target"] == "engine1" and lines[0]["outcome"] == "ok"
    assert lines[1]["healed"] == ["engine1"] and lines[1]["torn"] == []
    after = ctl.check_integrity()  # the re-synced replica has its peer's checksums
    assert after.ok and after.check.bytes == ctl.summary.bytes_total


def test_the_background_check_finds_and_heals_an_outsider_write(env):
    cfg, trainers, replicas, ctl = env
    ctl.shutdown()
    watched = cfg.replace(integrity={"mode": "sample", "fraction": 0.5},
                          integrity_watch_s=0.2, integrity_watch_bytes=256 << 10)
    ctl2 = WeightTransferController(trainers=trainers, engines=replicas, config=watched)
    try:
        ctl2.setup()
        seen = {}

        def during_update(version):  # between the writes and the check: no tick may run
            before = ctl2.watch.ticks
            time.sleep(5 * watched.integrity_watch_s)
            seen["ticks"] = (before, ctl2.watch.ticks)

        ctl2.after_transfer = during_update
        train(trainers, 2)
        ctl2.update(10)
        ctl2.after_transfer = None
        assert seen["ticks"][0] == seen["ticks"][1]
        ref = ctl2.state.served.get("engine0")
        assert ref.source == "engine" and ref.version == 10 and ref.nbytes > 0
        assert ctl2.check_integrity().ok  # the engines' reference matches what they serve
        start = len(read_audit(cfg.audit_path))
        # The outsider's write landed (process_vm_writev wrote the inverted byte); no read of
        # the engine's bytes here: a tick 0.2 s later may already have found and healed it.
        name = outsider_flip(replicas[0][0], 5, 3)
        deadline = time.monotonic() + WAIT_S
        while not (lines := [x for x in read_audit(cfg.audit_path)[start:]
                             if x["kind"] == "check" and x["bad"]]):
            assert time.monotonic() < deadline, "the background check did not find the write"
            time.sleep(0.2)
        (line,) = lines
        assert line["mode"] == "tick" and line["bad"] == ["engine0"]
        assert line["healed"] == ["engine0"], line
        peer = ctl2.state.served.get("engine1").nbytes  # the peer was checked in full first
        assert line["integrity"]["bytes"] > peer and line["integrity"]["ok"] is False
        assert any(f"engine0/tp0 tensor '{name}'" in m for m in line["integrity"]["mismatches"])
        assert stale(cfg, trainers, replicas[0]) == [] and stale(cfg, trainers, replicas[1]) == []
        assert ctl2.weights_version() == {"engine0": 10, "engine1": 10}
        counts = ctl2.metrics.snapshot()["wt_integrity_mismatches"]
        assert counts[(("check", "tick"), ("replica", "engine0"))] >= 1
        assert ctl2.check_integrity().ok
    finally:
        ctl2.shutdown()
