"""The RL loop example for two iterations on a local Ray instance: rollouts sampled from the
replicas, rewards in [0, 1], REINFORCE steps, and the replicas' weights version advancing."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from actors.demo.rl_loop import advantages_of, run_rl, toy_reward
from actors.run_config import RlConfig, load_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_reward_and_advantages():
    rl = RlConfig(target_start=10, target_end=20)
    assert toy_reward([10, 19, 20, 9], rl) == 0.5
    assert advantages_of([1.0, 0.0, 0.5]) == [0.5, -0.5, 0.0]


def test_two_iterations_advance_the_replicas_version(ray_job):  # on the shared cluster
    run = load_run_config("configs/runs/rl_loop.yaml")
    run = run.with_overrides(rl={**run.rl.model_dump(), "iterations": 2})
    console = Console(record=True, width=160)
    history = run_rl(run, console)
    assert [h["iteration"] for h in history] == [1, 2]
    for h in history:
        assert h["weights_version"] == {"engine0": h["iteration"], "engine1": h["iteration"]}
        assert len(h["rewards"]) == run.rl.prompts
        assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in h["rewards"])
        assert math.isfinite(h["loss"]) and h["update_bytes"] > 0
    assert "iteration 2: mean reward" in console.export_text()
