"""The RL loop example on the shared Ray cluster: rollouts sampled from the replicas, rewards
in [0, 1], REINFORCE steps, and the replicas' weights version advancing; then overlapped.
Both runs go over one set of actors (``run_rl(..., actors=)``: a controller of each run set up
over them), started once for the module: the loop, not the actors' start, is the subject."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from actors.tools.demo.rl_loop import (
    advantages_of,
    launch_rl_actors,
    rl_transfer_config,
    run_rl,
    toy_reward,
)
from actors.tools.demo.run_config import RlConfig, load_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_reward_and_advantages():
    rl = RlConfig(target_start=10, target_end=20)
    assert toy_reward([10, 19, 20, 9], rl) == 0.5
    assert advantages_of([1.0, 0.0, 0.5]) == [0.5, -0.5, 0.0]


def rl_run(cluster_file, **rl):
    """configs/runs/rl_loop.yaml on 2 trainer ranks -> 2 replicas x TP1 (the loop, not the
    shape, is the subject: two replicas keep what "every replica's version" means)."""
    run = load_run_config("configs/runs/rl_loop.yaml")
    return run.with_overrides(rl={**run.rl.model_dump(), **rl},
                              cluster=str(cluster_file(trainers=2, replicas=2, tp=1)))


@pytest.fixture(scope="module")
def rl_actors(ray_job, cluster_file, tmp_path_factory):  # on the shared cluster
    run = rl_run(cluster_file)
    trainers, replicas = launch_rl_actors(run, rl_transfer_config(run),
                                          tmp_path_factory.mktemp("rl"))
    with trainers, replicas:
        yield trainers, replicas


def test_two_iterations_advance_the_replicas_version(rl_actors, cluster_file):
    run = rl_run(cluster_file, iterations=2)
    console = Console(record=True, width=160)
    history = run_rl(run, console, actors=rl_actors)
    assert [h["iteration"] for h in history] == [1, 2]
    for h in history:
        assert h["weights_version"] == {"engine0": h["iteration"], "engine1": h["iteration"]}
        assert len(h["rewards"]) == run.rl.prompts
        assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in h["rewards"])
        assert math.isfinite(h["loss"]) and h["update_bytes"] > 0
    assert "iteration 2: mean reward" in console.export_text()


def test_overlapped_rollouts_carry_versions_and_stale_ones_are_dropped(rl_actors, cluster_file):
    """Rollouts sampled during the policy step and the update (``overlap``) start at the
    version before it; with ``max_lag=0`` exactly those are dropped, the count printed."""
    run = rl_run(cluster_file, iterations=3, overlap=True, max_lag=0)
    console = Console(record=True, width=200)
    history = run_rl(run, console, actors=rl_actors)
    text = console.export_text()
    for it, h in enumerate(history):
        assert len(h["versions"]) == run.rl.prompts == h["kept"] + h["dropped"]
        for versions in h["versions"]:  # each rollout: versions it-1 then it, in order
            assert versions == sorted(versions) and set(versions) <= {it - 1, it}, versions
        stale = sum(min(v) < it for v in h["versions"])
        assert h["dropped"] == stale
        assert (h["loss"] is None) == (stale == run.rl.prompts)
        assert f"iteration {it + 1}: " in text
        assert f"dropped {h['dropped']} of {run.rl.prompts} rollouts more than 0" in text
    assert history[0]["dropped"] == 0  # sampled after update 0, before the first step
    # iteration 2's rollouts began while the trainers stepped (version 0 still served)
    assert history[1]["dropped"] > 0
