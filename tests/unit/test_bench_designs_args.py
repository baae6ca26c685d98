"""``wt bench designs``: bad arguments are refused with exit code 2 and a message naming the
option, before Ray or any engine starts; each engine maps to its fleet and bench."""

from __future__ import annotations

import pytest

from actors.engine_registry import engine_names
from actors.tools.bench.designs.bench import _bench_class, run
from actors.tools.bench.designs.fleet import DesignBench, ReferenceBench
from actors.tools.demo.run_config import ROOT
from actors.tools.engine_tools import has_tool


def _run(**kw):
    args = dict(config=ROOT / "configs/runs/demo.yaml", model=None, nic_gbps=0.05, updates=1,
                designs="p2p,rank0", bucket="1M", caps_off=False, timeout_s=10.0,
                json_path=None, png=None)
    return run(**(args | kw))


@pytest.mark.parametrize(("kw", "named"), [
    ({"engine": "sglang"}, "--engine 'sglang'"),
    ({"designs": "rank0,rpc"}, "no p2p"),
    ({"designs": "p2p,nccl"}, "unknown ['nccl']"),
    ({"designs": "p2p,native"}, "native runs with --trainer deepspeed or megatron, not fsdp2"),
    ({"trainer": "jax"}, "unknown trainer 'jax' (choose from deepspeed, fsdp2"),
])
def test_bad_arguments_exit_2_naming_the_option(kw, named, capsys):
    assert _run(**kw) == 2
    out = capsys.readouterr()
    assert named in " ".join((out.out + out.err).split())


def test_each_engine_has_a_fleet_and_a_bench():
    assert {n for n in engine_names() if has_tool(n, "bench")} == {
        "reference", "vllm"}
    start, cls = _bench_class("reference")
    assert cls is ReferenceBench and start.__module__ == "actors.tools.demo.fleet"
    start, cls = _bench_class("vllm")
    assert issubclass(cls, DesignBench) and cls.engine == "vllm"
    assert start.__module__ == "actors.tools.demo.vllm_demo"
