"""The pure parts of LoRA over a user's engine (issue 35): the step boundary's order and
timing, the step stamp of an AsyncLLM output, and the mixins' ``wt_lora`` dispatch refusing
bad calls by name (the engine itself: tests/integration/test_vllm_async_actor.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from actors.vllm.engine import LORA_METHODS, AttachedLoras
from weight_transfer.engines.vllm.async_link import step_stamp
from weight_transfer.engines.vllm.driver import timed_boundary


def test_the_step_boundary_runs_in_order_and_serves_again_after_a_failure():
    seen = []
    took = timed_boundary(lambda: seen.append("fn"), stop=lambda: seen.append("stop"),
                          reset=lambda: seen.append("reset"), go=lambda: seen.append("go"))
    assert seen == ["stop", "fn", "reset", "go"] and took >= 0
    seen.clear()

    def boom():
        raise RuntimeError("swap failed")

    with pytest.raises(RuntimeError, match="swap failed"):
        timed_boundary(boom, stop=lambda: seen.append("stop"),
                       reset=lambda: seen.append("reset"), go=lambda: seen.append("go"))
    assert seen == ["stop", "go"]  # no reset after a failed fn; the engine serves again


@pytest.mark.parametrize(("metrics", "engine_stamp"), [
    (SimpleNamespace(last_token_ts=123.5), True),  # vLLM logs stats: the engine step's
    (SimpleNamespace(last_token_ts=0.0), False),   # no token stamped yet: now
    (None, False),                                 # stats off: now
])
def test_an_output_is_stamped_by_its_engine_step_else_by_its_arrival(metrics, engine_stamp):
    before = time.monotonic()
    stamp = step_stamp(SimpleNamespace(metrics=metrics))
    if engine_stamp:
        assert stamp == 123.5
    else:
        assert before <= stamp <= time.monotonic()


def test_wt_lora_refuses_bad_calls_by_name():
    loras = AttachedLoras()
    with pytest.raises(RuntimeError, match=r"call self\.wt_attach_vllm\(engine, replica=\.\.\.\)"):
        loras.call(None, "policy", "flip", (), {})
    owner = SimpleNamespace(replica="engine3")
    with pytest.raises(ValueError, match=r"unknown method 'swap'; known: \['begin', 'close'"):
        loras.call(owner, "policy", "swap", (), {})
    with pytest.raises(ValueError, match=r"no adapter 'policy' set up on engine3 \(set up: "
                                         r"\[\]\); call wt_lora\('policy', 'setup', adapter\)"):
        loras.call(owner, "policy", "flip", (1,), {})
    assert {"setup", "begin", "flip", "rollback", "discard", "close"} <= LORA_METHODS


def test_wt_lora_runs_the_adapters_methods_and_forgets_a_closed_one():
    calls = []
    lora = SimpleNamespace(version="3", lora_int_id=1,
                           flip=lambda v: calls.append(("flip", v)) or 0.01,
                           close=lambda: calls.append(("close",)))
    loras = AttachedLoras()
    loras.links["policy"] = lora
    owner = SimpleNamespace(replica="engine0")
    assert loras.call(owner, "policy", "flip", (4,), {}) == 0.01
    assert loras.call(owner, "policy", "version", (), {}) == "3"
    loras.call(owner, "policy", "close", (), {})
    assert calls == [("flip", 4), ("close",)] and loras.links == {}


def test_wt_lora_refuses_a_second_id_for_a_served_name():
    loras = AttachedLoras()
    loras.links["policy"] = SimpleNamespace(lora_int_id=1)
    with pytest.raises(ValueError, match=r"adapter 'policy' is served under id 1, not 2"):
        loras.call(SimpleNamespace(replica="engine0"), "policy", "setup", (object(),),
                   {"lora_int_id": 2})
