"""The engine contract (no Ray running): the EngineRank protocol and its implementations, the
engine registry, the KEEP sentinel, and the launch handles' ownership."""

from __future__ import annotations

import inspect
import pickle

import pytest

from actors.controller.engine_control import fan_out
from actors.engine_registry import (
    engine_names,
    engine_spec,
    register_engine,
    unregister_engine,
)
from actors.inference import InferenceMixin
from actors.ready.handles import Launched
from actors.tools.testkit.hooks import EngineFaultHooks, FaultyInferenceWorker, TrainerFaultHooks
from actors.vllm.engine import OwnerMethod, VllmEngineOwner, VllmRank
from weight_transfer.engines.fence import KEEP, CommandFence
from weight_transfer.engines.rank import ENGINE_RANK_METHODS, EngineRank, method_name

# What the controller and its helpers call on an engine rank.
CONTROLLER_CALLS = {"wt_engine_meta", "wt_host", "wt_endpoints", "wt_connect_peers",
                    "wt_pause", "wt_resume", "wt_set_version", "wt_checksum", "wt_copy_to",
                    "wt_close"}


def test_the_protocol_lists_every_method_the_controller_calls():
    assert CONTROLLER_CALLS <= ENGINE_RANK_METHODS


def _params(fn):
    return [p for p in inspect.signature(fn).parameters
            if p != "_ray_trace_ctx"]  # added by ray.remote's tracing wrapper


@pytest.mark.parametrize("protocol", ["EngineRank", "ShadowEngineRank"])
def test_both_engines_implement_the_protocol_with_its_parameters(protocol):
    from weight_transfer.engines import rank as contract

    methods = {"EngineRank": ENGINE_RANK_METHODS,
               "ShadowEngineRank": contract.SHADOW_RANK_METHODS}[protocol]
    for name in methods:
        want = _params(getattr(getattr(contract, protocol), name))
        assert _params(getattr(InferenceMixin, name)) == want, ("InferenceMixin", name)
        # vLLM: the replica's owner implements it for a rank given first; the rank
        # handle carries every method, with nothing of its own in between
        assert _params(getattr(VllmEngineOwner, name)) == ["self", "rank", *want[1:]], name
        assert isinstance(vars(VllmRank)[name], OwnerMethod), name


def test_a_vllm_rank_is_one_ray_call_into_its_owner_naming_its_rank():
    sent = []

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args, **kwargs):
            sent.append((self.name, args, kwargs))
            return f"ref-{self.name}"

    class Owner:
        def __getattr__(self, name):
            return Method(name)

    owner = Owner()
    rank = VllmRank(owner, 1)
    assert rank.wt_pause.remote(5.0, epoch=3) == "ref-wt_pause"
    assert rank.wt_checksum.remote("rows") == "ref-wt_checksum"
    assert rank.generate.remote([[1]], 2) == "ref-generate"  # the replica's, no rank
    assert sent == [("wt_pause", (1, 5.0), {"epoch": 3}), ("wt_checksum", (1, "rows"), {}),
                    ("generate", ([[1]], 2), {})]
    with pytest.raises(AttributeError):
        rank.wt_paus  # noqa: B018 - not a method of the protocol
    back = pickle.loads(pickle.dumps(VllmRank("owner", 2)))
    assert (back.owner, back.rank) == ("owner", 2)


def test_production_actors_carry_no_fault_hooks():
    hooks = {n for c in (EngineFaultHooks, TrainerFaultHooks) for n in vars(c)
             if n.startswith("wt_")}
    from actors.trainer import TrainerMixin

    for cls in (InferenceMixin, VllmEngineOwner, VllmRank, TrainerMixin):
        assert not hooks & set(dir(cls)), cls
    assert {"wt_flip_byte", "wt_deregister"} <= set(dir(FaultyInferenceWorker))


def test_methods_are_named_by_protocol_members_not_strings():
    assert method_name(EngineRank.wt_pause) == "wt_pause"
    for bad in ("wt_pause", InferenceMixin.wt_pause, lambda a: a.wt_pause):
        with pytest.raises(TypeError, match="member of EngineRank"):
            method_name(bad)
    with pytest.raises(AttributeError):
        EngineRank.wt_paus  # noqa: B018 - a typo fails where it is written
    with pytest.raises(TypeError):
        fan_out(None, {}, [], "wt_pause", until=0.0)


def test_keep_survives_pickling_and_keeps_the_version():
    assert pickle.loads(pickle.dumps(KEEP)) is KEEP
    fence = CommandFence("engine0")
    assert fence.resume(3, None, None, go=lambda: None) and fence.version == 3
    assert fence.resume(pickle.loads(pickle.dumps(KEEP)), 5, None, go=lambda: None)
    assert fence.version == 3
    assert fence.pause(4, stop=lambda: None) is False  # older than 5: ignored
    assert fence.events()[-1][0] == "stale pause"


def test_the_registry_resolves_names_once_and_refuses_duplicates_and_unknowns():
    assert {"reference", "vllm"} <= set(engine_names())
    assert engine_spec("reference").launcher().__name__ == "launch_engines"
    with pytest.raises(ValueError, match="already registered"):
        register_engine("reference", "x", "y")
    with pytest.raises(ValueError, match=r"unknown engine 'sglang'.*reference, vllm"):
        engine_spec("sglang")
    register_engine("tmp_engine", "actors.ready.launch", "launch_engines")
    unregister_engine("tmp_engine")
    assert "tmp_engine" not in engine_names()


def test_the_tools_hooks_are_named_apart_from_the_library_registry():
    from actors.tools.engine_tools import engine_tool, register_tools, unregister_tools

    with pytest.raises(ValueError, match="has no 'bench'"):
        engine_tool("tmp_engine", "bench")
    with pytest.raises(ValueError, match="module:attribute"):
        register_tools("tmp_engine", bench="no-colon")
    with pytest.raises(ValueError, match="unknown hooks"):
        register_tools("tmp_engine", benchmark="m:f")
    register_tools("tmp_engine", bench="actors.tools.bench.designs.fleet:ReferenceBench")
    assert engine_tool("tmp_engine", "bench").__name__ == "ReferenceBench"
    unregister_tools("tmp_engine")


def test_a_run_config_names_a_registered_engine():
    from actors.tools.demo.run_config import ROOT, load_run_config

    run = load_run_config(ROOT / "configs/runs/demo.yaml")
    with pytest.raises(ValueError, match="registered engines"):
        run.with_overrides(engine="sglang")


class FakeActor:
    def __init__(self, log, name):
        self.log, self.name = log, name


def test_a_launch_handle_is_a_sequence_and_closes_what_it_owns(monkeypatch):
    import ray

    killed, removed = [], []
    monkeypatch.setattr(ray, "kill", lambda a: killed.append(a))
    monkeypatch.setattr("actors.ready.handles.remove_groups", lambda gs: removed.extend(gs))
    a, b, c = object(), object(), object()
    h = Launched.merge([Launched([[a, b]], groups=["pg0"]), Launched([[c]], groups=["pg1"])],
                       what="engines")
    assert len(h) == 2 and h[0] == [a, b] and list(h) == [[a, b], [c]]
    assert h.actors == [a, b, c] and h.replicas == [[a, b], [c]]
    (first, _) = h
    assert first == [a, b]
    with h:
        pass
    assert killed == [a, b, c] and removed == ["pg0", "pg1"]
    h.close()  # idempotent
    assert killed == [a, b, c]


def test_the_vllm_backend_opens_the_update_window_only_for_the_writes():
    """vLLM's update hooks in our backend open the NICs' update window (tcp) at
    start_weight_update and close it at finish_weight_update, before reprocessing."""
    from types import SimpleNamespace

    from actors.tools.testkit.vllm_oracle import vllm_missing

    if (why := vllm_missing()) is not None:
        pytest.skip(why)
    from weight_transfer.engines.vllm.backend import OneSidedBackend

    calls: list[str] = []
    mem = SimpleNamespace(open_window=lambda: calls.append("open"),
                          close_window=lambda: calls.append("close"))
    rank = SimpleNamespace(mem=mem, owner="engine0/tp0", _repack=[], finished=0,
                           _standby=None, _shadow=None)
    OneSidedBackend.start_weight_update(rank)
    assert calls == ["open"]
    OneSidedBackend.finish_weight_update(rank)
    assert calls == ["open", "close"] and rank.finished == 1
