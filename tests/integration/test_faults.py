"""Actor faults end to end on local Ray: each ends in a clear error within a bounded time,
the other replicas keep the new version, torn replicas never serve, and the next setup,
re-sync or update heals them.

One module-wide cluster (tiny_llama, 2 FSDP2 trainer actors -> 2 replicas x TP2, NICs
capped so that an update's writes last long enough to be hit) goes through, in order:
an engine rank killed before an update, one killed during an update (both replicas
come back through ``add_replica``), ``remove_replica``, an engine rank stopped with
SIGSTOP during an update (then ``resync``), a revoked region (then ``setup()`` again)
and a trainer rank killed mid-update (then new trainers, ``setup(trainers=...)``).
Then ``wt soak`` and ``wt chaos`` run on the same actors, and last ``wt chaos --apply
shadow`` (its faults, a stopped engine rank and a killed trainer rank, each judged as a
transaction) through a second controller, in shadow mode, over the same actors.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch

from actors import (
    TransferConfig,
    UpdateError,
    WeightTransferController,
    launch_engines,
    launch_trainers,
)
from actors.connections import engine_endpoints
from actors.tools.testkit.hooks import FaultyInferenceActor, FaultyTrainerActor
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.sender.prepare import as_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# A stopped rank is found out when the update timeout passes: short, yet many times the
# 0.2-0.5 s a healthy update's capped writes take.
UPDATE_TIMEOUT_S = 10.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def env(ray_job, cluster_file):  # a Ray job of its own on the shared cluster
    cfg = TransferConfig.from_files(  # 2 trainer ranks: the faults are the engines' or one rank's
        CONFIGS / "models" / "tiny_llama.yaml", cluster_file(trainers=2, replicas=2, tp=2),
        update_timeout_s=UPDATE_TIMEOUT_S, barrier_timeout_s=10,  # setup: 300 s, slow starts
        nic_gbps=0.01)  # about 0.2-0.5 s of writes per update: long enough to hit one
    trainers = launch_trainers(cfg, actor_cls=FaultyTrainerActor)  # actors.tools.testkit hooks
    ctl = WeightTransferController(trainers=trainers, config=cfg,
                                   engines=launch_engines(cfg, actor_cls=FaultyInferenceActor))
    ctl.setup()
    state = {"cfg": cfg, "ctl": ctl, "version": 0}
    yield state


def next_version(env) -> int:
    env["version"] += 1
    return env["version"]


def during_transfer(ctl, fault):
    """Run ``fault()`` once, right after every trainer got "go" (ctl.progress hook)."""
    def hook(phase, done, total):
        if phase == "transfer" and done == 0:
            ctl.progress = None
            fault()
    ctl.progress = hook


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def mismatches(env, names=None):
    """(replica, rank, tensor) whose bytes differ from the trainers' current weights."""
    ctl, cfg = env["ctl"], env["cfg"]
    state = ray.get([t.full_state_dict.remote() for t in ctl.trainers])[0]
    bad = []
    for name in names or list(ctl.replicas):
        for actor in ctl.replicas[name]:
            meta = ray.get(actor.wt_engine_meta.remote())
            got = ray.get(actor.engine_state_bytes.remote())
            want = load_engine_shard(cfg.model, state, meta.shard, fp8=False)
            bad += [(name, meta.rank, n) for n in want
                    if not torch.equal(got[n], as_bytes(want[n]).reshape(-1))]
    return bad


def serving(ctl, name) -> list[tuple[bool, int | None]]:
    """(paused, version) the engine ranks of ``name`` say they have."""
    return [(ray.get(a.wt_paused.remote()), ray.get(a.wt_version.remote()))
            for a in ctl.replicas[name]]


def healthy_update(env) -> int:
    """One update that must reach every replica, exactly."""
    ctl = env["ctl"]
    version = next_version(env)
    report = ctl.update(version)
    assert report.bytes == ctl.summary.bytes_total
    assert ctl.weights_version() == {n: version for n in ctl.replicas}
    assert all(serving(ctl, n) == [(False, version)] * 2 for n in ctl.replicas)
    assert mismatches(env) == []
    return version


def train(ctl, step: int) -> None:
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(step))
    ray.get([t.train_step.remote(tokens.tolist()) for t in ctl.trainers])


def bring_back(env, index: int) -> None:
    """A new replica ``index`` filled from a peer (add_replica), then one healthy update."""
    ctl = env["ctl"]
    (new,) = launch_engines(env["cfg"], replicas=[index], actor_cls=FaultyInferenceActor)
    ctl.add_replica(new)
    healthy_update(env)


def test_baseline(env):
    train(env["ctl"], 1)
    healthy_update(env)


@pytest.mark.parametrize("when", ["before", "during"])
def test_engine_killed(env, when):
    ctl = env["ctl"]
    victim = ctl.replicas["engine1"][1]
    if when == "before":
        ray.kill(victim)
    else:
        during_transfer(ctl, lambda: ray.kill(victim))
    train(ctl, 2)
    version = next_version(env)
    start = time.monotonic()
    with pytest.raises(UpdateError, match="engine1") as exc:
        ctl.update(version)
    assert time.monotonic() - start < UPDATE_TIMEOUT_S + 10
    err = exc.value
    assert err.torn == ["engine1"] and err.lost == ["engine1"]
    assert "engine1/tp1" in err.replicas["engine1"] or "engine1" in str(err)
    # The other replica got the update and serves it; the dead one is out of the plan.
    assert ctl.weights_version() == {"engine0": version}
    assert serving(ctl, "engine0") == [(False, version)] * 2
    assert mismatches(env) == []
    assert ctl.summary.replicas == ("engine0",)
    healthy_update(env)  # later updates no longer trip over the dead rank
    bring_back(env, 1)


def test_remove_replica_and_bad_names(env):
    ctl = env["ctl"]
    before = ctl.summary.bytes_total
    with pytest.raises(ValueError, match="no replica 'engine9'"):
        ctl.remove_replica("engine9")
    actors = ctl.replicas["engine1"]
    gone = [(ep.owner, ep.nic) for m in ctl.state.engine_metas["engine1"]
            for ep in engine_endpoints(m)]
    ctl.remove_replica("engine1")
    # The trainers closed their connections to its NICs: none is left to disconnect.
    assert [ray.get(t.wt_disconnect.remote(gone)) for t in ctl.trainers] == \
        [0] * len(ctl.trainers)
    assert "engine1" not in ctl.weights_version()
    assert ctl.summary.bytes_total == before // 2
    assert ray.get(actors[0].wt_transport.remote()) is None  # its NICs are closed
    with pytest.raises(ValueError, match="last replica"):
        ctl.remove_replica("engine0")
    healthy_update(env)
    for a in actors:
        ray.kill(a)
    bring_back(env, 1)


@pytest.mark.parametrize("when", ["before", "during"])
def test_engine_stopped(env, when):
    ctl = env["ctl"]
    stopped = ctl.replicas["engine1"][1]
    pid = pid_of(stopped)
    if when == "before":  # its pause does not answer: the others must still get the update
        os.kill(pid, signal.SIGSTOP)
    else:  # its resume does not answer
        during_transfer(ctl, lambda: os.kill(pid, signal.SIGSTOP))
    train(ctl, 3)
    version = next_version(env)
    start = time.monotonic()
    # During: stopped after its writes, it answers neither the integrity check (on by
    # default) nor, with the check off, the resume.
    step = "pause" if when == "before" else "(checksum|resume)"
    try:
        with pytest.raises(UpdateError, match=f"engine1/tp1 unresponsive at wt_{step}") as exc:
            ctl.update(version)
        took = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < UPDATE_TIMEOUT_S + 8  # the update timeout, the hold wait, not setup's
    assert exc.value.torn == ["engine1"] and exc.value.resynced == []
    assert ctl.weights_version() == {"engine0": version, "engine1": None}
    assert serving(ctl, "engine0") == [(False, version)] * 2
    # The stopped rank continued: it ran its queued commands and holds like its peer.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and serving(ctl, "engine1") != [(True, None)] * 2:
        time.sleep(0.2)
    assert serving(ctl, "engine1") == [(True, None)] * 2
    events = [e for e, _, _ in ray.get(stopped.wt_events.remote())]
    assert "resume" not in events[-2:]  # its queued pause (before) or resume (during), the hold
    if "unresponsive at wt_resume" in str(exc.value):  # a resume was sent: it was refused
        assert {"late resume", "stale resume"} & set(events[-2:])
    # On request, from the peer, no trainer traffic.
    sent = ray.get([t.wt_nic_stats.remote() for t in ctl.trainers])
    assert ctl.resync("engine1") == version
    assert ray.get([t.wt_nic_stats.remote() for t in ctl.trainers]) == sent
    assert ctl.metrics.snapshot()["wt_replica_version"][(("replica", "engine1"),)] == version
    assert serving(ctl, "engine1") == [(False, version)] * 2
    assert mismatches(env) == []
    healthy_update(env)


def test_revoked_region_then_setup_again(env):
    ctl = env["ctl"]
    ray.get(ctl.replicas["engine1"][0].wt_deregister.remote())
    train(ctl, 4)
    version = next_version(env)
    with pytest.raises(UpdateError, match="engine1") as exc:
        ctl.update(version)
    assert "RemoteAccessError" in str(exc.value) and "deregistered" in str(exc.value)
    assert exc.value.torn == ["engine1"]
    assert exc.value.resynced == []  # the peer copy hits the revoked region too
    assert ctl.weights_version() == {"engine0": version, "engine1": None}
    assert serving(ctl, "engine1") == [(True, None)] * 2
    ctl.setup()  # registers engine1's buffers again and re-plans; versions kept
    assert ctl.weights_version() == {"engine0": version, "engine1": None}
    healthy_update(env)


def test_trainer_killed_mid_update_then_replaced(env):
    ctl, cfg = env["ctl"], env["cfg"]
    old = list(ctl.trainers)
    during_transfer(ctl, lambda: ray.kill(old[1]))
    version = next_version(env)
    start = time.monotonic()
    with pytest.raises(UpdateError, match=r"trainer ranks \[.*1.*\]") as exc:
        ctl.update(version)
    assert time.monotonic() - start < UPDATE_TIMEOUT_S + 8
    assert "trainer rank 1" in str(exc.value)
    assert exc.value.torn == sorted(ctl.replicas)  # rank 1's and the stuck ranks' replicas
    assert ctl.weights_version() == {n: None for n in ctl.replicas}
    assert all(serving(ctl, n) == [(True, None)] * 2 for n in ctl.replicas)
    for t in old:  # the survivors' gloo group lost a member: replace every rank
        ray.kill(t)
    ctl.setup(trainers=launch_trainers(cfg, actor_cls=FaultyTrainerActor))
    train(ctl, 5)
    healthy_update(env)


# ---------------------------------------------------------------- the commands, same actors


@pytest.fixture(scope="module")
def fleet(env):
    from actors.tools.demo.fleet import Fleet
    from actors.tools.demo.run_config import load_run_config

    ctl = env["ctl"]
    return Fleet(run=load_run_config(CONFIGS / "runs" / "demo.yaml"), config=env["cfg"],
                 trainers=list(ctl.trainers), replicas=dict(ctl.replicas), controller=ctl,
                 setup_seconds=0.0)


def test_wt_soak_nothing_grows(env, fleet, tmp_path):
    from actors.tools.demo import soak

    out = tmp_path / "soak.json"
    assert soak.run(config=CONFIGS / "runs" / "demo.yaml", updates=20, json_path=out,
                    fleet=fleet, first_version=env["version"] + 1) == 0
    doc = json.loads(out.read_text())
    env["version"] = doc["last_version"]
    assert doc["updates"] == 20 and doc["ok"] and doc["verified"]
    assert ctl_versions(env) == {n: doc["last_version"] for n in env["ctl"].replicas}
    procs = doc["actors"]
    assert {"controller", "scheduler", "trainer0", "trainer1", "engine0/tp0",
            "engine1/tp1"} <= set(procs)
    for row in procs.values():
        assert all(row["start"][k] > 0 and row["end"][k] > 0
                   for k in ("rss_bytes", "fds", "threads"))
    # the barrier store is empty between updates; the groups' stores hold their gloo keys
    assert procs["controller"]["start"]["store_keys"] == procs["controller"]["end"]["store_keys"]
    assert procs["trainer0"]["end"]["store_keys"] == procs["trainer0"]["start"]["store_keys"] > 0


def ctl_versions(env):
    return env["ctl"].weights_version()


def test_wt_chaos_json(env, fleet, tmp_path):
    from actors.tools.demo import chaos

    out = tmp_path / "chaos.json"
    faults = ["nic-link-down", "nic-transient-error", "region-revoked"]
    code = chaos.run(config=CONFIGS / "runs" / "demo.yaml", faults=",".join(faults),
                     update_timeout_s=UPDATE_TIMEOUT_S, nic_gbps=0.01, json_path=out,
                     fleet=fleet)
    rows = json.loads(out.read_text())
    assert [r["fault"] for r in rows] == faults
    for row in rows:
        assert {"fault", "ok", "detect_s", "healed"} <= set(row)
        assert row["ok"] and row["healed"], row
        assert 0 <= row["detect_s"] < UPDATE_TIMEOUT_S + 30
    assert rows[2]["torn"] == ["engine1"] and "deregistered" in rows[2]["outcome"]
    assert code == 0
    assert chaos.run(config=CONFIGS / "runs" / "demo.yaml", faults="no-such-fault",
                     update_timeout_s=1, nic_gbps=0.01, json_path=None, fleet=fleet) == 2


def test_wt_chaos_in_shadow_mode_tears_nothing_and_heals(env, fleet, tmp_path):
    """``wt chaos --apply shadow``: no replica torn, every replica serving a complete
    version it reports, a client on the spared replica never waiting longer than one flip,
    and the next update heals (:mod:`actors.tools.demo.chaos_shadow`). The last test: it
    replaces the trainers."""
    from actors.tools.demo import chaos
    from actors.tools.demo.fleet import Fleet

    ctl = env["ctl"]
    # the in-place chaos run counted its own versions; every replica holds its last one
    env["version"] = max(v for v in ctl.weights_version().values() if v is not None)
    ctl.shutdown()
    cfg = env["cfg"].replace(apply="shadow")
    shadow = WeightTransferController(trainers=list(ctl.trainers), config=cfg,
                                      engines=[ctl.replicas[n] for n in sorted(ctl.replicas)])
    try:
        shadow.setup()
        shadow.update(next_version(env))  # chaos goes on from the version the replicas hold
        active = Fleet(run=fleet.run, config=cfg, trainers=list(shadow.trainers),
                       replicas=dict(shadow.replicas), controller=shadow, setup_seconds=0.0)
        out = tmp_path / "chaos.json"
        rc = chaos.run(config=CONFIGS / "runs" / "demo.yaml",
                       faults="engine-stopped-during,trainer-killed-during",
                       update_timeout_s=UPDATE_TIMEOUT_S, nic_gbps=0.01, json_path=out,
                       fleet=active, apply="shadow")
    finally:
        shadow.shutdown()
    rows = json.loads(out.read_text())
    assert [r["fault"] for r in rows] == ["engine-stopped-during", "trainer-killed-during"]
    for r in rows:
        assert r["ok"] and r["healed"] and r["torn"] == [], r
        assert "longest wait" in r["outcome"] and "kept" in r["outcome"], r
    assert rc == 0
