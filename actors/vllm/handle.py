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

A LoRA adapter served by your engine (started with ``enable_lora=True``, ``max_loras``
>= 2) is driven through the second remote method, ``wt_lora(name, method, *args)``: one
:class:`~weight_transfer.engines.vllm.lora.link.LoraLink` per adapter name over the
attached link, set up on the replica's NICs (those of the full-weight registration,
made first if the controller has not yet)::

    metas = ray.get(actor.wt_lora.remote("policy", "setup", describe_peft(peft_model)))
    request = ray.get(actor.wt_lora.remote("policy", "request"))  # your LoRARequest
    slot = ray.get(actor.wt_lora.remote("policy", "begin", base_version))
    ...                               # the trainers write_adapter(nic, metas[r], slot, ...)
    ray.get(actor.wt_lora.remote("policy", "flip", 3))         # at a step boundary
    ray.get(actor.wt_lora.remote("policy", "rollback"))

``method`` is one of :data:`~actors.vllm.engine.LORA_METHODS` (``version``: the adapter
version served); a replica's owner actor (``replicas.owners``) takes the same calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from actors.config import TransferConfig
from actors.ready.handles import Launched
from actors.vllm.engine import AttachedLoras, VllmEngineOwner, VllmRank

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
    _wt_loras: AttachedLoras | None = None

    def wt_attach_vllm(self, llm: Any, *, replica: int = 0,
                       config: TransferConfig | None = None) -> None:
        from weight_transfer.engines.vllm.driver import VllmLink

        self._wt_vllm_owner = attached_owner(VllmLink(llm), replica, config)
        self._wt_loras = AttachedLoras()

    def wt_vllm(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return dispatch(self._wt_vllm_owner, method, args, kwargs)

    def wt_lora(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the served adapter ``name`` (see the module docstring)."""
        return (self._wt_loras or AttachedLoras()).call(self._wt_vllm_owner, name, method,
                                                        args, kwargs)


class AsyncVllmWeightsMixin:
    """For an async Ray actor that holds an ``AsyncLLM``; see the module docstring."""

    _wt_vllm_owner: VllmEngineOwner | None = None
    _wt_loras: AttachedLoras | None = None

    def wt_attach_vllm(self, engine: Any, *, replica: int = 0,
                       config: TransferConfig | None = None, pause_mode: str = "keep",
                       recompute: bool = True) -> None:
        from weight_transfer.engines.vllm.async_link import AsyncLink

        link = AsyncLink(engine, pause_mode=pause_mode, recompute=recompute)
        self._wt_vllm_owner = attached_owner(link, replica, config)
        self._wt_loras = AttachedLoras()

    def _wt_owner_on_loop(self) -> VllmEngineOwner | None:
        owner = self._wt_vllm_owner
        if owner is not None and owner.link.loop is None:
            owner.link.loop = asyncio.get_running_loop()
        return owner

    async def wt_vllm(self, method: str, *args: Any, **kwargs: Any) -> Any:
        owner = self._wt_owner_on_loop()
        # A thread: the owner's blocking calls submit vLLM's coroutines to this loop.
        return await asyncio.to_thread(dispatch, owner, method, args, kwargs)

    async def wt_lora(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the served adapter ``name`` (see the module docstring), in a
        thread beside the loop: the actor's requests keep streaming; a flip pauses them
        at a step boundary in mode ``keep``."""
        owner = self._wt_owner_on_loop()
        loras = self._wt_loras or AttachedLoras()
        return await asyncio.to_thread(loras.call, owner, name, method, args, kwargs)


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
