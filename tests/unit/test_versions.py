"""Version-tagged generations: the shared type, vLLM's spans converted, the reference engine's
per-step recording (an update landing mid-request splits a sequence into two spans whose
tokens come from each version's weights), and the RL loop's staleness filter."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from weight_transfer.engines.reference.ops import greedy_loop
from weight_transfer.sync.versions import (
    Generation,
    VersionRecorder,
    VersionSpan,
    fresh,
    from_vllm,
    parse_version,
)

WAIT = 120.0  # only bounds a failure


def _gen(tokens, *spans):
    return Generation(tokens=tuple(tokens),
                      spans=tuple(VersionSpan(version=v, start=s) for v, s in spans))


@pytest.mark.parametrize("label, want", [
    (7, 7), ("7", 7), (" 12 ", 12), ("-1", -1), ("default", None), ("none", None),
    (None, None), (True, None), ("7b", None)])
def test_parse_version(label, want):
    assert parse_version(label) == want


def test_spans_are_checked():
    with pytest.raises(ValueError, match="must start at token 0"):
        _gen([1, 2], (3, 1))
    with pytest.raises(ValueError, match="must start at token 0"):
        _gen([1, 2])
    with pytest.raises(ValueError, match="must increase"):
        _gen([1, 2, 3], (3, 0), (4, 2), (5, 2))
    with pytest.raises(ValueError, match="stay below 3 tokens"):
        _gen([1, 2, 3], (3, 0), (4, 3))
    assert _gen([], ).versions == ()


def test_generation_lag_and_span_ends():
    g = _gen([5, 9, 2, 4], (3, 0), (4, 2))
    assert g.versions == (3, 4) and g.oldest == 3 and g.lag(5) == 2
    assert g.span_ends() == [(3, 0, 2), (4, 2, 4)]
    unknown = _gen([1], (None, 0))
    assert unknown.oldest is None and unknown.lag(5) is None


def test_from_vllm_spans():
    span = lambda v, s, e: SimpleNamespace(version=v, start=s, end=e)  # noqa: E731
    g = from_vllm([1, 2, 3, 4], [span("3", 0, 1), span("3", 1, 2), span("4", 2, 4)])
    assert g.spans == (VersionSpan(version=3, start=0), VersionSpan(version=4, start=2))
    assert from_vllm([1, 2], None).versions == (None,)  # vLLM reported no label
    assert from_vllm([1], [span("default", 0, 1)]).versions == (None,)
    assert from_vllm([], []).spans == ()


def test_recorder_splits_at_a_version_change():
    rec = VersionRecorder(2)
    for v in (1, 1, "2", 2, None):
        rec.step(v)
    a, b = rec.generations([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    assert a.spans == b.spans == (VersionSpan(version=1, start=0),
                                  VersionSpan(version=2, start=2),
                                  VersionSpan(version=None, start=4))


def test_fresh_drops_stale_and_unknown():
    gens = [_gen([1], (5, 0)), _gen([1, 2], (3, 0), (5, 1)), _gen([1], (4, 0)),
            _gen([1], (None, 0))]
    assert fresh(gens, current=5, max_lag=1) == ([0, 2], 2)
    assert fresh(gens, current=5, max_lag=2) == ([0, 1, 2], 1)
    with pytest.raises(ValueError, match="max_lag must be >= 0"):
        fresh(gens, current=5, max_lag=-1)


def test_greedy_loop_tags_each_length_group():
    versions = iter([1, 1, 2, 2, 2, 2])  # the first group's steps, then the second's
    logits = lambda ids: torch.nn.functional.one_hot(ids[:, -1] % 7, 7).float()  # noqa: E731
    out = greedy_loop([[1, 2], [3]], 3, logits, version_of=lambda: next(versions))
    assert [list(g.tokens) for g in out] == [[2, 2, 2], [3, 3, 3]]
    assert out[0].spans == (VersionSpan(version=1, start=0), VersionSpan(version=2, start=2))
    assert out[1].versions == (2,)
    assert greedy_loop([[1, 2]], 2, logits) == [[2, 2]]  # untagged without version_of


def test_reference_engine_spans_follow_an_update_between_steps():
    """A pause during step 2, the weights and the version changed while parked: steps 1-2
    came from version 1's weights, steps 3-6 from version 2's."""
    from weight_transfer.engines.reference.adapter import ReferenceEngineAdapter
    from weight_transfer.engines.reference.engine import ReferenceEngine
    from weight_transfer.engines.reference.hf_model import build_hf_model, greedy_generate
    from weight_transfer.model.models import load_model_config
    from weight_transfer.types import ShardSpec

    cfg = load_model_config(Path(__file__).resolve().parents[2]
                            / "configs/models/tiny_llama.yaml")
    old, new = build_hf_model(cfg, seed=1), build_hf_model(cfg, seed=2)
    engine = ReferenceEngine(cfg, ShardSpec(), fp8=False)
    engine.load_state(old.state_dict())
    adapter = ReferenceEngineAdapter(engine)
    held = {"version": 1}
    engine.version_of = lambda: held["version"]
    forward, calls = engine.forward, []

    def pausing_forward(ids):
        calls.append(1)
        if len(calls) == 2:
            adapter.pause()
        return forward(ids)

    engine.forward = pausing_forward
    prompts, result = [[1, 2, 3], [4, 5, 6]], {}
    thread = threading.Thread(target=lambda: result.update(
        gens=engine.generate_tagged(prompts, 6)), daemon=True)
    thread.start()
    assert adapter.wait_parked(WAIT)
    engine.load_state(new.state_dict())
    held["version"] = 2
    adapter.resume()
    thread.join(WAIT)
    first = greedy_generate(old, prompts, max_new_tokens=2)
    rest = greedy_generate(new, [p + f for p, f in zip(prompts, first, strict=True)], 4)
    for g, f, r in zip(result["gens"], first, rest, strict=True):
        assert list(g.tokens) == f + r
        assert g.spans == (VersionSpan(version=1, start=0), VersionSpan(version=2, start=2))


def test_a_shadow_flip_mid_request_tags_the_steps_after_it():
    """The reference engine in shadow mode: a flip lands while a request generates; the
    steps before it carry the old version, those after it the new one, and their tokens
    come from each version's weights."""
    from weight_transfer.engines.fence import CommandFence
    from weight_transfer.engines.reference.adapter import ReferenceEngineAdapter
    from weight_transfer.engines.reference.engine import ReferenceEngine
    from weight_transfer.engines.reference.hf_model import build_hf_model, greedy_generate
    from weight_transfer.engines.registered import RegisteredMemory
    from weight_transfer.engines.shadow.rank import ShadowControl
    from weight_transfer.model.models import load_model_config
    from weight_transfer.types import ShardSpec

    cfg = load_model_config(Path(__file__).resolve().parents[2]
                            / "configs/models/tiny_llama.yaml")
    old, new = build_hf_model(cfg, seed=1), build_hf_model(cfg, seed=2)
    engine, donor = (ReferenceEngine(cfg, ShardSpec(), fp8=False) for _ in range(2))
    engine.load_state(old.state_dict())
    donor.load_state(new.state_dict())
    adapter, fence = ReferenceEngineAdapter(engine), CommandFence("engine0/tp0")
    ctl = ShadowControl("engine0/tp0", "reference", fence=fence,
                        mem=RegisteredMemory("engine0/tp0"), boundary=adapter)
    ctl.setup(adapter.region_buffers(), adapter.shadow_buffers())
    assert fence.set_version(1, epoch=1)
    engine.version_of = lambda: fence.served
    assert ctl.stage(2, epoch=2)
    ctl.require().shadow[0].copy_(donor.buffer.view(-1).view(torch.uint8))  # the writes
    forward, calls, at_two = engine.forward, [], threading.Event()

    def slow_forward(ids):
        calls.append(1)
        if len(calls) == 2:  # step 2 ends only once the flip waits for its boundary
            at_two.set()
            deadline = time.monotonic() + WAIT
            while not adapter.paused and time.monotonic() < deadline:
                time.sleep(0.001)
        return forward(ids)

    engine.forward = slow_forward
    prompts, result = [[1, 2, 3]], {}
    thread = threading.Thread(target=lambda: result.update(
        gens=engine.generate_tagged(prompts, 12)), daemon=True)
    thread.start()
    assert at_two.wait(WAIT)
    assert ctl.flip(2, epoch=3, deadline=None)
    thread.join(WAIT)
    (g,) = result["gens"]
    assert g.versions == (1, 2), g.spans
    k = g.spans[1].start
    assert k == 2  # the flip landed at the boundary after step 2
    head = greedy_generate(old, prompts, max_new_tokens=k)
    tail = greedy_generate(new, [prompts[0] + head[0]], max_new_tokens=12 - k)
    assert list(g.tokens) == head[0] + tail[0]
