"""The engine adapter: regions for registration, pause/resume at generation step boundaries.

No test depends on timing: a pause is issued from inside a chosen forward step
(so where generation stops is known), waits have generous timeouts that only
bound a failure, and what is checked is the step count and the tokens.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from weight_transfer.engines.adapter import EngineAdapter
from weight_transfer.engines.reference.adapter import ReferenceEngineAdapter
from weight_transfer.engines.reference.engine import ReferenceEngine
from weight_transfer.engines.reference.hf_model import build_hf_model, greedy_generate
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.model.models import load_model_config
from weight_transfer.types import ShardSpec

CFG = load_model_config(Path(__file__).resolve().parents[2] / "configs/models/tiny_llama.yaml")
PROMPTS = [[1, 2, 3], [4, 5, 6]]
STEPS = 6
WAIT = 120.0  # only bounds a failure


@pytest.fixture(scope="module")
def models():
    return build_hf_model(CFG, seed=1), build_hf_model(CFG, seed=2)


@pytest.fixture
def setup(models, monkeypatch):
    engine = ReferenceEngine(CFG, ShardSpec(), fp8=False)
    engine.load_state(models[0].state_dict())
    adapter = ReferenceEngineAdapter(engine)
    calls = []
    paused_in_step = threading.Event()
    forward = engine.forward

    def counting_forward(ids):
        calls.append(ids.shape[1])
        if len(calls) == 2:  # a pause arrives while step 2 runs
            adapter.pause()
            paused_in_step.set()
        return forward(ids)

    monkeypatch.setattr(engine, "forward", counting_forward)
    return engine, adapter, calls, paused_in_step


def run_in_thread(engine):
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(tokens=engine.generate(PROMPTS, STEPS)), daemon=True
    )
    thread.start()
    return thread, result


def test_region_buffers_are_the_engine_buffer(setup):
    engine, adapter, _, _ = setup
    assert isinstance(adapter, EngineAdapter)
    [(buf, tensors)] = adapter.region_buffers()
    assert buf.data_ptr() == engine.buffer.data_ptr() and buf.numel() == engine.buffer.numel()
    assert tensors == engine.specs()


def test_generation_is_held_at_a_step_boundary_and_continues(setup, models):
    engine, adapter, calls, paused_in_step = setup
    thread, result = run_in_thread(engine)
    assert paused_in_step.wait(WAIT)
    assert adapter.paused and adapter.wait_parked(WAIT) and adapter.wait_idle(0)
    assert len(calls) == 2 and thread.is_alive()  # step 2 finished, step 3 held
    adapter.resume()
    thread.join(WAIT)
    assert not thread.is_alive() and len(calls) == STEPS and not adapter.paused
    assert result["tokens"] == greedy_generate(models[0], PROMPTS, STEPS)


def test_weights_written_while_paused_are_used_after_resume(setup, models):
    engine, adapter, _, paused_in_step = setup
    old, new = models
    thread, result = run_in_thread(engine)
    assert paused_in_step.wait(WAIT) and adapter.wait_idle(WAIT)
    for name, t in load_engine_shard(CFG, new.state_dict(), ShardSpec(), fp8=False).items():
        raw = t.contiguous().view(torch.uint8).flatten()
        engine.buffer[engine.offsets[name] : engine.offsets[name] + raw.numel()] = raw
    adapter.resume()
    thread.join(WAIT)
    first = greedy_generate(old, PROMPTS, 2)  # two steps with the old weights
    rest = greedy_generate(new, [p + f for p, f in zip(PROMPTS, first, strict=True)], STEPS - 2)
    assert result["tokens"] == [f + r for f, r in zip(first, rest, strict=True)]
    assert result["tokens"] != greedy_generate(old, PROMPTS, STEPS)


def test_pause_is_idempotent_and_idle_engine_is_idle(setup):
    engine, adapter, calls, _ = setup
    assert adapter.wait_idle(0) and not adapter.paused and not adapter.wait_parked(0)
    adapter.pause()
    adapter.pause()
    adapter.resume()  # one resume undoes any number of pauses
    assert not adapter.paused
    adapter.resume()
    assert engine.generate([[7]], 1) and calls == [1]


def test_one_adapter_per_engine(setup):
    engine, _, _, _ = setup
    with pytest.raises(ValueError, match="already has a step_guard"):
        ReferenceEngineAdapter(engine)
