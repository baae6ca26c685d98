"""End to end on the shared Ray cluster: 2 FSDP2 trainer actors -> 2 replicas x TP2 (tiny_llama;
the demo runs the 4-rank, 2-node shape of ``configs/clusters/local_cpu.yaml``).

The ``reference-fleet`` group's actors (``tests/integration/conftest.py``: shared with the
integrity, replica-group and shadow modules, each with controllers of its own) go through,
in order: rounds of a real optimizer
step and an update (every engine byte equals the reference layout of the
trainer's current weights; greedy generations equal the trainer model's token
for token), pause/resume ordering, a failed update (a trainer NIC's link down)
that marks replicas torn and names the rank, recovery, a third replica filled
from a peer without the trainers, a revoked engine region, and FP8 engines.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from actors import UpdateError, WeightTransferController, launch_engines
from actors.tools.testkit.engine_bytes import engine_mismatches
from actors.tools.testkit.hooks import FaultyInferenceActor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999], [12, 600, 3, 77, 5, 41]]


@pytest.fixture(scope="module")
def env(reference_fleet):  # trainers with wt_set_link, engines with wt_deregister
    cfg = reference_fleet.config(update_timeout_s=120, barrier_timeout_s=60)
    trainers, replicas = reference_fleet.trainers, reference_fleet.replicas
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    yield cfg, trainers, replicas, ctl
    ctl.shutdown()


def train(trainers, step: int) -> float:
    tokens = torch.randint(0, 1000, (4, 24), generator=torch.Generator().manual_seed(step))
    losses = ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    assert len(set(losses)) == 1  # every rank reports the same all-reduced loss
    return losses[0]


def mismatches(cfg, trainers, replicas, *, fp8=False):
    """Engine tensors whose bytes differ from the reference layout of the trainer's weights."""
    return engine_mismatches(cfg.model, trainers, replicas, fp8=fp8)


def generations(replicas, n=6):
    return [ray.get([a.generate.remote(PROMPTS, n) for a in rep])[0] for rep in replicas]


def test_calls_before_setup_are_refused(env):
    _, trainers, replicas, ctl = env
    with pytest.raises(RuntimeError, match=r"update\(\) before setup\(\)"):
        ctl.update(1)
    with pytest.raises(RuntimeError, match=r"add_replica\(\) before setup\(\)"):
        ctl.add_replica(replicas[0])
    with pytest.raises(ValueError, match="at least one engine"):
        WeightTransferController(trainers=trainers, engines=[], config=env[0])


def test_rounds_land_exact_bytes_and_generations(env):
    cfg, trainers, replicas, ctl = env
    summary = ctl.setup()
    assert summary.replicas == ("engine0", "engine1")
    assert sum(summary.bytes_by_rank.values()) == summary.bytes_total > 0
    assert ctl.weights_version() == {"engine0": None, "engine1": None}
    previous = None
    for version in (1, 2, 3):
        loss = train(trainers, version)
        assert loss > 0
        report = ctl.update(version)
        assert report.version == version
        assert report.bytes == summary.bytes_total
        assert report.seconds > 0 and report.transfer_seconds > 0
        assert report.stages["prepare"] > 0 and report.stages["write"] > 0
        assert set(report.stages) >= {"h2d", "prepare", "write", "barrier"}
        assert [r.rank for r in report.per_rank] == [0, 1]
        assert ctl.weights_version() == {"engine0": version, "engine1": version}
        assert mismatches(cfg, trainers, replicas) == []
        want = ray.get([t.reference_generate.remote(PROMPTS, 6) for t in trainers])[0]
        assert generations(replicas) == [want, want]
        assert want != previous  # the optimizer step changed what the model says
        previous = want
    with pytest.raises(ValueError, match="must be greater than 3"):
        ctl.update(3)
    assert ctl.weights_version() == {"engine0": 3, "engine1": 3}


def test_replicas_are_paused_exactly_while_trainers_write(env):
    _, trainers, replicas, ctl = env
    train(trainers, 4)
    report = ctl.update(4)
    first_go = min(r.started_at for r in report.per_rank)
    last_done = max(r.finished_at for r in report.per_rank)
    for rep in replicas:
        for actor in rep:
            assert ray.get(actor.wt_paused.remote()) is False
            assert ray.get(actor.wt_version.remote()) == 4
            events = ray.get(actor.wt_events.remote())
            pause = max(t for e, _, t in events if e == "pause")
            resume = max(t for e, _, t in events if e == "resume")
            # Causal order (one host clock): paused before any trainer got "go";
            # resumed with version 4 only after the last trainer's last write.
            assert pause < first_go <= last_done < resume
            assert [v for e, v, _ in events if e == "resume"][-1] == 4


def test_without_pause_replicas_keep_serving_and_record_the_version(env):
    _, trainers, replicas, ctl = env
    actors = [a for rep in replicas for a in rep]
    seen = [len(ray.get(a.wt_events.remote())) for a in actors]
    ctl.pause_during_update = False
    try:
        train(trainers, 5)
        ctl.update(5)
    finally:
        ctl.pause_during_update = True
    for actor, n in zip(actors, seen, strict=True):
        new = ray.get(actor.wt_events.remote())[n:]
        assert [(e, v) for e, v, _ in new] == [("version", 5)]  # never paused
        assert ray.get(actor.wt_paused.remote()) is False
    assert ctl.weights_version() == {"engine0": 5, "engine1": 5}


def test_failed_update_marks_replicas_torn_and_names_the_rank(env):
    cfg, trainers, replicas, ctl = env
    train(trainers, 6)
    ray.get(trainers[1].wt_set_link.remote(False))
    ctl.auto_resync = False  # keep them torn (test_faults covers the re-sync from a peer)
    try:
        with pytest.raises(UpdateError, match=r"version 6 failed on trainer ranks \[1\]") as exc:
            ctl.update(6)
    finally:
        ray.get(trainers[1].wt_set_link.remote(True))
        ctl.auto_resync = True
    torn = list(ctl.summary.replicas_by_rank[1])
    assert exc.value.torn == torn and exc.value.ranks.keys() == {1}
    assert "link" in str(exc.value) and "trainer rank 1" in str(exc.value)
    versions = ctl.weights_version()
    assert all(versions[r] is None for r in torn)
    for name in torn:  # a torn replica never serves: it stays paused
        for actor in ctl.replicas[name]:
            assert ray.get(actor.wt_paused.remote()) is True
            assert ray.get(actor.wt_version.remote()) is None
    report = ctl.update(7)  # the same weights again, over a healthy link
    assert report.bytes == ctl.summary.bytes_total
    assert ctl.weights_version() == {"engine0": 7, "engine1": 7}
    assert not any(ray.get(a.wt_paused.remote()) for rep in replicas for a in rep)
    assert mismatches(cfg, trainers, replicas) == []


def test_add_replica_is_filled_from_a_peer_without_the_trainers(env):
    cfg, trainers, replicas, ctl = env
    (new,) = launch_engines(cfg, replicas=[2], actor_cls=FaultyInferenceActor)  # revoked
    before = ray.get([t.wt_nic_stats.remote() for t in trainers])
    old_bytes = ctl.summary.bytes_total
    name = ctl.add_replica(new)
    assert name == "engine2"
    assert ray.get([t.wt_nic_stats.remote() for t in trainers]) == before  # no trainer wrote
    assert ctl.weights_version() == {"engine0": 7, "engine1": 7, "engine2": 7}
    copied = sum(ray.get(a.wt_nic_stats.remote())["bytes_written"]
                 for a in ctl.replicas["engine0"] + ctl.replicas["engine1"])
    assert copied == sum(m.tensors[0].region.length for m in
                         ray.get([a.wt_engine_meta.remote() for a in new]))
    assert mismatches(cfg, trainers, [new]) == []
    # The new replica joins the next update: one re-plan, more bytes, exact again.
    assert ctl.summary.replicas == ("engine0", "engine1", "engine2")
    assert ray.get(ctl.scheduler.count.remote()) == 2
    train(trainers, 8)
    report = ctl.update(8)
    assert report.bytes == ctl.summary.bytes_total == old_bytes * 3 // 2
    assert mismatches(cfg, trainers, [*replicas, new]) == []
    with pytest.raises(ValueError, match="already part of this controller"):
        ctl.add_replica(new)


def test_a_revoked_engine_region_tears_only_its_replica(env):
    _, trainers, _, ctl = env
    ray.get(ctl.replicas["engine2"][1].wt_deregister.remote())
    train(trainers, 9)
    with pytest.raises(UpdateError, match="engine2") as exc:
        ctl.update(9)
    assert exc.value.torn == ["engine2"]
    assert "RemoteAccessError" in str(exc.value) and "deregistered" in str(exc.value)
    assert ctl.weights_version() == {"engine0": 9, "engine1": 9, "engine2": None}


@pytest.fixture(scope="module")
def fp8_replicas(env):
    """One FP8 replica, set up by each gather mode's controller in turn."""
    with launch_engines(env[0].replace(fp8=True), replicas=[0]) as replicas:
        yield replicas


@pytest.mark.parametrize("gather", ["shard_direct", "full"])
def test_fp8_engines_hold_the_reference_quantization(env, fp8_replicas, gather):
    cfg, trainers, _, _ = env
    fp8_cfg = cfg.replace(fp8=True, gather=gather)
    ctl = WeightTransferController(trainers=trainers, engines=fp8_replicas, config=fp8_cfg)
    summary = ctl.setup()  # the trainers now replay the FP8 plan
    assert summary.gather == gather and (summary.direct_bytes > 0) == (gather != "full")
    train(trainers, 10)
    report = ctl.update(10)
    assert report.bytes == summary.bytes_total
    assert mismatches(cfg, trainers, fp8_replicas, fp8=True) == []
    ids = [p + [0] * 2 for p in PROMPTS]
    want = ray.get([t.reference_logits.remote(ids) for t in trainers])[0]
    got = ray.get([a.logits.remote(ids) for a in fp8_replicas[0]])[0]
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 0.1, f"FP8 logits differ by {rel:.3f} of the largest logit"


def test_no_model_or_cluster_file_with_live_actors(env):
    """docs/embedding.md's TransferConfig() alone: the model from trainer 0's live model,
    the cluster from the actors (2 trainer ranks, 2 replicas x TP2); exact bytes land."""
    cfg, trainers, replicas, _ = env
    from actors.tools.testkit.doc_snippets import snippet as doc_snippet

    snippet = doc_snippet(Path(__file__).resolve().parents[2] / "docs" / "embedding.md",
                          "live-config")
    train(trainers, 11)
    ns = {"trainers": trainers, "replicas": replicas, "step": 11}
    exec(snippet, ns)
    ctl = ns["ctl"]
    assert ctl.config.model is None and ctl.config.cluster.trainer_world == 2
    assert (ctl.config.cluster.inference.replicas, ctl.config.cluster.inference.tensor_parallel,
            ctl.config.cluster.source) == (2, 2, "")
    assert ns["report"].bytes == ctl.summary.bytes_total > 0
    assert mismatches(cfg, trainers, replicas) == []


def test_both_gather_modes_land_the_reference_bytes(env):
    """FSDP, bf16: after a step, an update gathering every parameter and one writing
    shard-direct pieces from the owners' shards each land every reference byte."""
    cfg, trainers, replicas, _ = env
    for step, gather in ((12, "full"), (13, "shard_direct")):
        ctl = WeightTransferController(trainers=trainers, engines=replicas,
                                       config=cfg.replace(gather=gather))
        summary = ctl.setup()
        train(trainers, step)
        report = ctl.update(step, trace=True)
        assert report.bytes == summary.bytes_total
        assert mismatches(cfg, trainers, replicas) == [], gather
        assert summary.gather == gather
        if gather == "full":
            assert summary.direct_bytes == 0
        else:  # all but the norms: their parts would be tiny, they are gathered
            assert summary.direct_bytes > 0.95 * summary.bytes_total
            assert summary.send_imbalance < 1.2


def test_an_update_that_overlaps_a_step_writes_from_snapshots(env):
    """``ctl.update(v, overlap=True)`` (an asynchronous loop: the trainers step meanwhile):
    ``source: auto`` writes every rank's pieces from snapshots; without it, from the
    parameters themselves. Both land every reference byte."""
    cfg, trainers, replicas, _ = env
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    for step, overlap, want in ((14, True, "snapshot"), (15, None, "zero_copy")):
        train(trainers, step)
        report = ctl.update(step, overlap=overlap)
        assert report.sources == {0: want, 1: want}, overlap
        assert (report.zero_copy_bytes > 0) == (want == "zero_copy")
        assert mismatches(cfg, trainers, replicas) == [], overlap
