"""Integrity checks, NIC fault retries and the audit log, end to end on local Ray.

2 FSDP2 trainer ranks -> 2 replicas x TP2 (tiny_llama; the ``reference-fleet`` group's
actors, ``tests/integration/conftest.py``), integrity ``full``, an audit log. In order:
a clean update whose every range is checked; a byte corrupted in one engine rank's
memory after the writes landed (the controller's ``after_transfer`` hook, between the
writes and the check) tears only that replica, keeps it paused (automatic re-sync off)
and names replica, rank, tensor, range and both checksums, while the other replica
serves the new version; the next update heals it; with the default automatic re-sync, a
corrupted replica is re-filled from its peer at once and checked region by region; a
link flap on a trainer NIC is ridden out by retries; a link that stays down tears the
replicas and names NIC, peer and region. Every update left one audit line whose fields
match its report or error.
"""

from __future__ import annotations

import re

import pytest
import ray
import torch

from actors import UpdateError, WeightTransferController
from actors.controller.audit import read_audit
from actors.tools.testkit.engine_bytes import engine_mismatches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]


@pytest.fixture(scope="module")
def env(tmp_path_factory, reference_fleet):  # trainers with NIC faults, engines wt_flip_byte
    tmp = tmp_path_factory.mktemp("integrity")
    cfg = reference_fleet.config(
        update_timeout_s=120, integrity={"mode": "full"}, audit_path=tmp / "audit.jsonl",
        retry={"attempts": 8, "backoff_s": 0.05, "max_backoff_s": 0.5})  # ~2.8 s of patience
    trainers, replicas = reference_fleet.trainers, reference_fleet.replicas
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    outcomes = []  # (version, UpdateReport or UpdateError), for the audit test
    yield cfg, trainers, replicas, ctl, outcomes
    ctl.shutdown()


def train(trainers, step):
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(step))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])


def stale(cfg, trainers, replica):
    """(rank, tensor) of ``replica`` whose bytes differ from the trainer's current weights."""
    return [(rank, name) for _, rank, name in engine_mismatches(cfg.model, trainers, [replica])]


def update(ctl, outcomes, version):
    try:
        report = ctl.update(version)
    except UpdateError as err:
        outcomes.append((version, err))
        raise
    outcomes.append((version, report))
    return report


def test_full_mode_checks_every_written_range(env):
    _cfg, trainers, _replicas, ctl, outcomes = env
    train(trainers, 1)
    report = update(ctl, outcomes, 1)
    assert report.integrity.ok and report.integrity.mode == "full"
    assert report.integrity.ranges == ctl.summary.num_tasks
    assert report.integrity.bytes == report.bytes == ctl.summary.bytes_total
    assert ctl.weights_version() == {"engine0": 1, "engine1": 1}


def test_a_corrupted_byte_tears_only_its_replica_and_names_it(env):
    cfg, trainers, replicas, ctl, outcomes = env
    train(trainers, 2)
    victim = replicas[1][1]
    tensor = ray.get(victim.wt_engine_meta.remote()).tensors[3]
    ctl.after_transfer = lambda v: ray.get(victim.wt_flip_byte.remote(tensor.name, 17))
    ctl.auto_resync = False  # held torn (the re-sync is the test after the next)
    try:
        with pytest.raises(UpdateError) as err:
            update(ctl, outcomes, 2)
    finally:
        ctl.after_transfer = None
        ctl.auto_resync = True
    msg = str(err.value)
    assert err.value.torn == ["engine1"]
    assert re.search(rf"engine1/tp1 tensor '{re.escape(tensor.name)}' bytes \[\d+, \d+\) "
                     r"\(task \d+\): xxh3_64 expected 0x[0-9a-f]{16}, engine holds "
                     r"0x[0-9a-f]{16}", msg), msg
    assert ctl.weights_version() == {"engine0": 2, "engine1": None}
    assert all(ray.get([a.wt_paused.remote() for a in replicas[1]]))
    assert not any(ray.get([a.wt_paused.remote() for a in replicas[0]]))
    assert stale(cfg, trainers, replicas[0]) == []  # engine0 serves version 2
    assert stale(cfg, trainers, replicas[1]) == [(1, tensor.name)]  # just the flipped byte
    gen = ray.get([a.generate.remote(PROMPTS, 4) for a in replicas[0]])
    assert gen[0] == gen[1]


def test_the_next_update_heals_the_torn_replica(env):
    cfg, trainers, replicas, ctl, outcomes = env
    train(trainers, 3)
    report = update(ctl, outcomes, 3)
    assert report.integrity.ok
    assert ctl.weights_version() == {"engine0": 3, "engine1": 3}
    assert stale(cfg, trainers, replicas[1]) == []
    assert not any(ray.get([a.wt_paused.remote() for rep in replicas for a in rep]))


def test_a_corrupted_replica_is_resynced_from_its_peer(env):
    cfg, trainers, replicas, ctl, outcomes = env
    train(trainers, 4)
    victim = replicas[1][0]
    tensor = ray.get(victim.wt_engine_meta.remote()).tensors[5]
    ctl.after_transfer = lambda v: ray.get(victim.wt_flip_byte.remote(tensor.name, 3))
    try:
        with pytest.raises(UpdateError) as err:
            update(ctl, outcomes, 4)
    finally:
        ctl.after_transfer = None
    assert err.value.torn == ["engine1"] and err.value.resynced == ["engine1"]
    assert "engine1/tp0 tensor" in str(err.value) and "re-synced" in str(err.value)
    assert ctl.weights_version() == {"engine0": 4, "engine1": 4}
    assert stale(cfg, trainers, replicas[1]) == []  # the flipped byte was copied over
    assert not any(ray.get([a.wt_paused.remote() for rep in replicas for a in rep]))
    lines = [r for r in read_audit(cfg.audit_path) if r["kind"] == "resync"]
    assert len(lines) == 1 and lines[0]["outcome"] == "ok"
    assert lines[0]["source"] == "engine0" and lines[0]["target"] == "engine1"
    assert lines[0]["version"] == 4 and lines[0]["integrity"]["ok"]
    assert {(p["src"], p["dst"]) for p in lines[0]["pairs"]} == {
        ("engine0/tp0", "engine1/tp0"), ("engine0/tp1", "engine1/tp1")}


def test_a_link_flap_is_retried_and_the_update_succeeds(env):
    cfg, trainers, replicas, ctl, outcomes = env
    train(trainers, 5)
    ray.get(trainers[0].wt_flap_link.remote(0.3))  # down at its first write, for 0.3 s
    report = update(ctl, outcomes, 5)
    assert report.retries > 0
    assert report.per_rank[0].transfer.retries == report.retries  # only rank 0 flapped
    assert report.bytes == ctl.summary.bytes_total and report.integrity.ok
    assert ctl.weights_version() == {"engine0": 5, "engine1": 5}
    assert stale(cfg, trainers, replicas[0]) == stale(cfg, trainers, replicas[1]) == []


def test_a_link_that_stays_down_is_reported_and_tears_replicas(env):
    _cfg, trainers, _replicas, ctl, outcomes = env
    train(trainers, 6)
    ray.get(trainers[1].wt_set_link.remote(False))
    try:
        with pytest.raises(UpdateError) as err:
            update(ctl, outcomes, 6)
    finally:
        ray.get(trainers[1].wt_set_link.remote(True))
    msg = str(err.value)
    assert 1 in err.value.ranks and "RetriesExhaustedError" in msg
    assert re.search(r"NIC trainer1/\S+: write of \d+ B at offset \d+ into peer engine\d/tp\d/",
                     msg), msg
    assert "failed 8 tries" in msg and "region(owner=engine" in msg
    torn = ctl.summary.replicas_by_rank[1]
    assert sorted(err.value.torn) == sorted(torn)
    for n in torn:  # re-synced from a peer that got version 6, or held torn
        assert ctl.weights_version()[n] == (6 if n in err.value.resynced else None)
    assert set(err.value.resynced) <= set(torn)
    train(trainers, 7)
    update(ctl, outcomes, 7)
    assert ctl.weights_version() == {"engine0": 7, "engine1": 7}


def test_every_update_left_an_audit_line_matching_its_outcome(env):
    cfg, _trainers, _replicas, _ctl, outcomes = env
    lines = [r for r in read_audit(cfg.audit_path) if r["kind"] == "update"]
    assert [r["version"] for r in lines] == [v for v, _ in outcomes] == [1, 2, 3, 4, 5, 6, 7]
    for rec, (_version, out) in zip(lines, outcomes, strict=True):
        assert rec["kind"] == "update" and rec["started_at"] <= rec["finished_at"]
        assert rec["integrity"]["mode"] == "full"
        if isinstance(out, UpdateError):
            assert rec["outcome"] == "failed" and rec["error"] == str(out)
            assert rec["torn"] == sorted(out.torn)
            continue
        assert rec["outcome"] == "ok" and rec["torn"] == [] and rec["error"] is None
        assert rec["bytes"] == out.bytes and rec["retries"] == out.retries
        assert rec["integrity"]["ranges"] == out.integrity.ranges
        by_src = {}
        for p in rec["pairs"]:
            by_src[p["src"]] = by_src.get(p["src"], 0) + p["bytes"]
        assert by_src == {f"trainer{r.rank}": r.transfer.bytes_written for r in out.per_rank}
        dsts = {p["dst"] for p in rec["pairs"]}
        assert dsts == {f"engine{i}/tp{j}" for i in range(2) for j in range(2)}
    corrupt = lines[1]
    assert corrupt["integrity"]["ok"] is False and corrupt["torn"] == ["engine1"]
    assert "engine1/tp1" in corrupt["integrity"]["mismatches"][0]
