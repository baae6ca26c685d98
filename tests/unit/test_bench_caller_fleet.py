"""Benchmarks on a caller's fleet (``fleet=``): the versions go on above the fleet
controller's, and a fleet the bench cannot measure is refused naming why, before any update."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.tools.bench.caller_fleet import check_fleet, next_version
from actors.tools.bench.stall.bench import check_args


def controller(attempted, versions):
    return SimpleNamespace(state=SimpleNamespace(attempted=attempted),
                           weights_version=lambda: dict(versions))


@pytest.mark.parametrize(("attempted", "versions", "first"), [
    (None, {"engine0": None}, 1),  # a fleet that never updated
    (3, {"engine0": 3, "engine1": 3}, 4),
    (5, {"engine0": 4, "engine1": None}, 6),  # version 5 tore: still refused by the controller
    (None, {"engine0": 7}, 8),  # a controller set up over replicas that hold a version
])
def test_the_next_version_is_above_every_one_attempted_or_held(attempted, versions, first):
    assert next_version(controller(attempted, versions)) == first


def fleet(engine="vllm", apply="in_place"):
    return SimpleNamespace(engine=engine, config=SimpleNamespace(apply=apply))


def test_a_fleet_of_another_engine_is_refused_naming_both():
    check_fleet(fleet(), "vllm", "wt bench designs")
    with pytest.raises(ValueError, match="runs engine 'vllm', not 'reference'"):
        check_fleet(fleet(), "reference", "wt bench designs")


@pytest.mark.parametrize(("kw", "named"), [
    ({"fleet": fleet(apply="shadow")}, "apply='shadow'"),
    ({"fleet": fleet(), "nic_gbps": 1.0}, "nic_gbps and cluster"),
    ({"fleet": fleet(), "cluster": "tp1.yaml"}, "nic_gbps and cluster"),
    ({"fleet": fleet(engine="reference")}, "runs engine 'reference'"),
])
def test_the_stall_bench_refuses_a_fleet_it_cannot_measure(kw, named):
    args = {"engine": "vllm", "updates": 1, "nic_gbps": None, "cluster": None} | kw
    with pytest.raises(ValueError, match=named):
        check_args(**args)
