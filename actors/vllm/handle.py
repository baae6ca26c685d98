"""Your own vLLM in your own Ray actor (OpenRLHF's ``LLMRayActor`` shape), handed to the controller.

You build the engine with your own engine arguments and our backend's one
config value, and add one mixin and one line; your generation code is yours
(your ``SamplingParams``, ``n``, logprobs)::

    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from actors.vllm.handle import VllmWeightsMixin, vllm_replicas

    @ray.remote
    class LLMRayActor(VllmWeightsMixin):
        def __init__(self, model, replica, **engine_args):
            self.llm = LLM(model, weight_transfer_config=WeightTransferConfig(
                backend="wt_onesided"), **engine_args)
            self.wt_attach_vllm(self.llm, replica=replica)          # the one line

        def generate(self, prompts, params: SamplingParams):
            return self.llm.generate(prompts, params)

    actors = [LLMRayActor.remote(path, i, max_model_len=1024) for i in range(2)]
    replicas = vllm_replicas(actors)       # a Launched handle: a VllmRank per TP rank
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)

An ``AsyncLLM`` in an async actor takes :class:`AsyncVllmWeightsMixin` and
``self.wt_attach_vllm(self.engine, replica=i, pause_mode="keep")``: the
controller's calls run in a thread beside the actor's event loop, so requests
keep streaming; vLLM pauses them in the mode you choose (``abort``, ``wait``,
``keep``) for the update, and their outputs' ``weight_versions`` say which
version sampled which tokens.

The mixin's one remote method ``wt_vllm(method, *args)`` runs the vLLM owner's
calls (:class:`actors.vllm.engine.VllmEngineOwner` over your engine): the
``VllmRank`` handles of :func:`vllm_replicas` send the controller's ``wt_*`` calls
there, by name. ``config``: a :class:`~actors.config.TransferConfig` whose cluster places
your replicas' NICs (the same as the controller's); without one, each rank's
NIC is the simulated cluster's (one per engine rank), which is what a
controller without a cluster derives. With an offline ``LLM`` in a plain
(one-call-at-a-time) actor, an update waits for a running ``generate`` to end.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from actors.config import TransferConfig
from actors.ready.handles import Launched
from actors.vllm.engine import VllmEngineOwner, VllmRank

# What ``wt_vllm`` runs: the owner's public methods (the rank handles' wt_* calls, the
# replica's own), plus "tp": the engine's TP size.
OWNER_METHODS = frozenset({name for name in vars(VllmEngineOwner) if not name.startswith("_")}
                          | {"tp"})


def attached_owner(link: Any, replica: int, config: TransferConfig | None) -> VllmEngineOwner:
    """The vLLM owner of replica ``replica`` over ``link``; the simulated cluster's NICs when
    ``config`` has no cluster."""
    return VllmEngineOwner(config_for_link(config, replica, link), replica, link=link)


def config_for_link(config: TransferConfig | None, replica: int, link: Any) -> TransferConfig:
    """``config``, or with no cluster one with the simulated cluster's NICs for replica
    ``replica`` at the engine's own TP (the controller derives the whole cluster from the
    actors at setup, as for every shape without a cluster file)."""
    config = config or TransferConfig()
    if config.cluster is not None:
        return config
    from scheduling.cluster.defaults import simulated_cluster

    return config.replace(cluster=simulated_cluster(
        trainer_ranks=1, replicas=replica + 1, tensor_parallel=link.tp_size))


def dispatch(owner: VllmEngineOwner | None, method: str, args: tuple, kwargs: dict) -> Any:
    if owner is None:
        raise RuntimeError("wt_vllm: call self.wt_attach_vllm(engine, replica=...) first")
    if method not in OWNER_METHODS:
        raise ValueError(f"wt_vllm: unknown method {method!r}; known: {sorted(OWNER_METHODS)}")
    if method == "tp":
        return owner.tp
    return getattr(owner, method)(*args, **kwargs)


class VllmWeightsMixin:
    """For a Ray actor that holds an offline ``vllm.LLM``; see the module docstring."""

    _wt_vllm_owner: VllmEngineOwner | None = None

    def wt_attach_vllm(self, llm: Any, *, replica: int = 0,
                       config: TransferConfig | None = None) -> None:
        from weight_transfer.engines.vllm.driver import VllmLink

        self._wt_vllm_owner = attached_owner(VllmLink(llm), replica, config)

    def wt_vllm(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return dispatch(self._wt_vllm_owner, method, args, kwargs)


class AsyncVllmWeightsMixin:
    """For an async Ray actor that holds an ``AsyncLLM``; see the module docstring."""

    _wt_vllm_owner: VllmEngineOwner | None = None

    def wt_attach_vllm(self, engine: Any, *, replica: int = 0,
                       config: TransferConfig | None = None, pause_mode: str = "keep",
                       recompute: bool = True) -> None:
        from weight_transfer.engines.vllm.async_link import AsyncLink

        link = AsyncLink(engine, pause_mode=pause_mode, recompute=recompute)
        self._wt_vllm_owner = attached_owner(link, replica, config)

    async def wt_vllm(self, method: str, *args: Any, **kwargs: Any) -> Any:
        owner = self._wt_vllm_owner
        if owner is not None and owner.link.loop is None:
            owner.link.loop = asyncio.get_running_loop()
        # A thread: the owner's blocking calls submit vLLM's coroutines to this loop.
        return await asyncio.to_thread(dispatch, owner, method, args, kwargs)


class _Method:
    __slots__ = ("actor", "name")

    def __init__(self, actor: Any, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.wt_vllm.remote(self.name, *args, **kwargs)


class AttachedOwner:
    """A user's actor seen as an owner actor: ``owner.wt_pause.remote(rank, ...)`` is
    ``actor.wt_vllm.remote("wt_pause", rank, ...)`` (what the ``VllmRank`` handles call)."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Method(self.actor, name)

    def __reduce__(self) -> tuple:
        return (AttachedOwner, (self.actor,))


def vllm_replicas(actors: list[Any], *, rank_cls: Any = None) -> Launched:
    """One replica per actor of yours (each with the mixin, attached): a handle of the
    replicas' ``VllmRank`` handles (one per TP rank, asked of each actor); your actors and
    engines stay yours."""
    owners = [AttachedOwner(a) for a in actors]
    tps = ray.get([a.wt_vllm.remote("tp") for a in actors])
    rank_cls = rank_cls or VllmRank
    ranks = [[rank_cls(o, r) for r in range(tp)] for o, tp in zip(owners, tps, strict=True)]
    return Launched(ranks, actors=[], what="vLLM replicas (your actors)")
