"""vLLM engines under Ray: one owner actor per replica, a plain rank handle per TP rank.

``VllmEngine`` owns a vLLM ``LLM`` (with our weight-transfer backend) and its
:class:`~weight_transfer.engines.vllm.driver.VllmLink`; vLLM runs the TP
workers itself. :class:`WeightTransferController` addresses one engine rank per
(replica, TP rank): a :class:`VllmRank`, a plain object over the owner whose
methods are the owner's protocol methods (``wt_engine_meta``, ``wt_endpoints``,
``wt_pause``, ``wt_resume``, ``wt_checksum`` ...) called with its rank, one Ray call
each and no actor in between. The controller is used unchanged::

    replicas = launch_vllm_engines(cfg, model_path)    # [[VllmRank, ...] per replica]
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    replicas.owners                                    # the VllmEngine actor of each replica
    replicas.close()                                   # vLLM shut down, every actor killed

Pause is idempotent over a replica's ranks (the first one stops the engine at a
step boundary); the replica resumes - ``finish_weight_update(version)``, a
prefix-cache reset - when its last rank has called ``wt_resume``. Commands are
fenced by the controller's epochs with the reference engine's fence
(:class:`weight_transfer.engines.fence.CommandFence`): a stale one is ignored, a resume
past its deadline refused (the replica stays paused); one fence per replica.
A rank is an :class:`~weight_transfer.engines.rank.EngineRank` and a
:class:`~weight_transfer.engines.rank.ShadowEngineRank` (shadow mode: :mod:`actors.vllm.shadow`).
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import ray

from actors.config import TransferConfig
from actors.connections import this_host
from actors.controller.live_config import check_actors
from actors.ready.handles import Launched, ReplicaRanks
from actors.vllm.shadow import VllmShadow
from weight_transfer.engines.fence import KEEP, CommandFence
from weight_transfer.engines.vllm.shm import engine_segments, stop_and_remove, unlink_at_exit


class VllmEngineOwner:
    """One replica: the ``LLM``, its workers' NICs (through our backend), pause/resume."""

    _loras: AttachedLoras | None = None  # its LoRA adapters (wt_lora), on first use

    def __init__(self, config: TransferConfig, replica: int, model_path: str | None = None, *,
                 dtype: str = "float32", engine_kw: dict | None = None,
                 env: dict[str, str] | None = None, link: Any = None) -> None:
        """Start an ``LLM`` of ``model_path`` (``engine_kw``: vLLM engine arguments over the
        small defaults), or drive an engine someone else started through ``link`` (a
        :class:`~weight_transfer.engines.vllm.driver.VllmLink` of the user's ``LLM``, or the
        links of :mod:`actors.vllm.handle`): its TP is checked against the cluster's."""
        cluster = config.cluster
        self.tp = cluster.inference.gpus_per_replica
        self.config, self.replica = config, cluster.replica_name(replica)
        self.nics = tuple((cluster.engine_rank(replica, r)[1],) for r in range(self.tp))
        self.owns_engine = link is None  # an engine we started is ours to shut down
        t0 = time.perf_counter()
        self.link = link if link is not None else self._start(model_path, dtype, engine_kw, env)
        self.start_seconds = time.perf_counter() - t0
        # What the engine's processes (ours, or a user's under this actor) map in /dev/shm:
        # removed after this process ends, however it ends (a user's ray.kill included).
        unlink_at_exit(engine_segments())
        if self.link.tp_size != self.tp:
            from scheduling.cluster.defaults import ClusterMismatchError

            raise ClusterMismatchError(
                f"{self.replica}: the vLLM engine runs TP={self.link.tp_size}, the cluster "
                f"({cluster.source or cluster.name}) says gpus_per_replica={self.tp}",
                field="inference.gpus_per_replica", expected=self.tp, actual=self.link.tp_size)
        self._metas: list | None = None
        self._lock = threading.Lock()
        self._generating = threading.Lock()  # one generate loop steps the engine at a time
        self._resumed: set[int] = set()
        # The controller gives every rank of a replica the same epoch: one fence per replica.
        self.fence = CommandFence(self.replica)
        self.shadow = VllmShadow(self.replica, self.link, self.fence)

    def _start(self, model_path: str | None, dtype: str, engine_kw: dict | None,
               env: dict[str, str] | None) -> Any:
        from weight_transfer.engines.vllm import BACKEND_NAME
        from weight_transfer.engines.vllm.driver import SMALL_ENGINE, VllmLink, executor_for

        if model_path is None:
            raise ValueError(f"{self.replica}: give model_path (an engine to start) or link")
        os.environ.update(env or {})  # read by vLLM's processes, e.g. its CPU thread binding
        if self.tp > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(self.tp))))
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        llm = LLM(model=model_path, dtype=dtype, tensor_parallel_size=self.tp,
                  weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME),
                  distributed_executor_backend=executor_for(self.tp),
                  **{**SMALL_ENGINE, **(engine_kw or {})})
        return VllmLink(llm)

    def _meta(self, rank: int, transport: Any = None, apply: str | None = None):
        """Rank ``rank``'s registered memory (registered once for the replica; ``apply``
        "shadow": the shadow is registered, replacing an in-place registration, and the
        reverse for "in_place"; None: the registration there is, else the config's mode)."""
        from weight_transfer.engines.vllm.mailbox import SetupRequest

        with self._lock:
            if apply is None and self._metas is not None:
                return self._metas[rank]  # a controller's plain call: keep the mode set up
        apply = apply or self.config.apply
        if apply == "shadow":
            self._require_shadow_link()
        with self._lock:
            if self._metas is not None and apply != getattr(self.link, "apply", "in_place"):
                self.link.call("close")  # registered in place: expose the shadow instead
                self._metas = None
            if self._metas is None:
                spec = transport or self.config.transport_spec
                self._metas = self.link.setup(SetupRequest(
                    replica=self.replica, nics=self.nics, transport=spec,
                    node=ray.get_runtime_context().get_node_id(),
                    address=this_host().address, apply=apply))
                if apply == "shadow":
                    self.shadow.memory = self.link.memory()
            return self._metas[rank]

    def _require_shadow_link(self) -> None:
        """ShadowError unless the link drives shadow mode (the offline ``LLM``'s VllmLink)."""
        if not hasattr(self.link, "flip"):
            from weight_transfer.engines.shadow.store import ShadowError

            raise ShadowError(f"{self.replica}: shadow mode needs an offline vLLM engine "
                              f"(VllmLink); this replica is driven through "
                              f"{type(self.link).__name__}: use apply='in_place'")

    def _in_worker(self, rank: int, op: str, request: Any = None) -> Any:
        """Our backend's ``op`` in the worker of TP rank ``rank`` (after its registration)."""
        self._meta(rank)
        return self.link.call(op, request, rank=rank)[0]

    # ------------------------------------------------------------------ the engine-rank
    # protocol (weight_transfer.engines.rank), each method for TP rank ``rank``: what the
    # :class:`VllmRank` handles call, with their rank first.

    def wt_engine_meta(self, rank: int, transport: Any = None):
        return self._meta(rank, transport)

    def wt_host(self, rank: int):
        return this_host()

    def wt_node_id(self, rank: int) -> str:
        return ray.get_runtime_context().get_node_id()

    def wt_endpoints(self, rank: int, requests: list) -> tuple:
        return self._in_worker(rank, "endpoints", list(requests))

    def wt_connect_peers(self, rank: int, conns: list) -> int:
        return self._in_worker(rank, "connect", list(conns))

    def wt_pause(self, rank: int, timeout_s: float = 60.0, epoch: int | None = None) -> bool:
        """Stop at a step boundary (once per replica: the first rank to ask stops it); a
        fenced pause makes the version held None until a resume names one. False: a stale
        command, ignored."""

        def stop() -> None:
            self._resumed.clear()
            if not self.link.gate.paused:
                self.link.pause(timeout_s)
                self.fence.record("pause")

        return self.fence.pause(epoch, stop)

    def wt_resume(self, rank: int, version: Any = KEEP, epoch: int | None = None,
                  deadline: float | None = None) -> bool:
        """Rank ``rank`` is done; the replica resumes (vLLM's finish_weight_update, a prefix
        cache reset) when all its ranks are. False (stays paused): stale, or past
        ``deadline``. ``KEEP``: no version given (the one held stays)."""

        def go() -> None:
            self._resumed.add(rank)
            if len(self._resumed) == self.tp and self.link.gate.paused:
                self.link.resume(None if version is KEEP else version)
                self.fence.record("resume")

        return self.fence.resume(version, epoch, deadline, go)

    def wt_set_version(self, rank: int, version: Any, epoch: int | None = None) -> bool:
        return self.fence.set_version(version, epoch, apply=self.link.set_version)

    def wt_version(self, rank: int) -> Any:
        return self.fence.version

    def wt_paused(self, rank: int) -> bool:
        return self.link.gate.paused

    def wt_events(self, rank: int) -> list:
        return self.fence.events()

    def wt_checksum(self, rank: int, ranges: Any) -> Any:
        """Hashes of (region address, offset, length) rows of this rank's registered memory."""
        return self._in_worker(rank, "checksum", ranges)

    def wt_copy_to(self, rank: int, dst: Any) -> int:
        return self._in_worker(rank, "copy_to", dst)

    def wt_nic_stats(self, rank: int) -> dict:
        return self._in_worker(rank, "stats")

    def wt_transport(self, rank: int) -> str:
        return self._meta(rank).tensors[0].region.transport

    def wt_close(self, rank: int) -> None:
        self._in_worker(rank, "close")

    # ---- shadow mode (ShadowEngineRank; actors.vllm.shadow): one shadow per replica

    def wt_shadow_setup(self, rank: int, transport: Any = None):
        self._meta(rank, transport, apply="shadow")
        return self.shadow.info(rank)

    def wt_shadow_info(self, rank: int):
        if getattr(self.link, "apply", "in_place") != "shadow":
            from weight_transfer.engines.shadow.store import ShadowError

            raise ShadowError(f"{self.replica}: shadow mode is not set up on this vLLM engine "
                              "(wt_shadow_setup() first)")
        return self.shadow.info(rank)

    def wt_stage(self, rank: int, version: Any, epoch: int | None = None,
                 base: bool = False) -> bool:
        """``base`` (a delta update) needs no copy here: vLLM's registered memory already
        holds the version served (a flip reprocesses from it; a rollback swaps it with
        the standby; a discard restores it), and the standby is saved at every stage."""
        return self.shadow.stage(version, epoch)

    def wt_flip(self, rank: int, version: Any, epoch: int | None = None,
                deadline: float | None = None) -> bool:
        return self.shadow.flip(version, epoch, deadline)

    def wt_rollback(self, rank: int, epoch: int | None = None,
                    deadline: float | None = None) -> bool:
        return self.shadow.rollback(epoch, deadline)

    def wt_discard_shadow(self, rank: int, epoch: int | None = None) -> bool:
        return self.shadow.discard(epoch)

    def wt_live_checksum(self, rank: int, ranges: Any) -> Any:
        """Hashes of the same rows in the version served (vllm shadow: see the backend)."""
        return self._in_worker(rank, "live_checksum", ranges)

    # ---- sparse deltas

    def wt_delta_arena(self, rank: int, slots: dict) -> Any:
        """This rank's delta arena, registered once in its worker."""
        return self._in_worker(rank, "delta_arena", slots)

    def wt_delta_apply(self, rank: int, version: int) -> Any:
        """Apply ``version``'s records in the worker, in place, before the resume's
        finish_weight_update reprocesses repacked layers."""
        from weight_transfer.engines.delta_rank import held_version

        held = held_version(self.fence.events(), self.fence.version)
        return self._in_worker(rank, "delta_apply", (version, held))

    # ------------------------------------------------------------------ the replica

    def step_times(self, since: float = 0.0) -> list[float]:
        """Wall-clock times (``time.time()``) of vLLM's engine steps that produced tokens
        since ``since`` (vLLM stamps them with the host-wide monotonic clock)."""
        clock = getattr(self.link, "clock", None)
        if clock is None:
            raise ValueError(f"{self.replica}: {type(self.link).__name__} does not time vLLM's "
                             "engine steps (VllmLink does)")
        offset = time.time() - time.monotonic()
        return [t + offset for t in clock.times() if t + offset >= since]

    def vllm_version(self) -> str:
        return self.link.version()

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
        with self._generating:  # the TP ranks' handles may ask at once
            return self.link.generate(prompts, max_new_tokens, temperature=temperature,
                                      seed=seed)

    def generate_tagged(self, prompts: list[list[int]], max_new_tokens: int,
                        temperature: float = 0.0, seed: int | None = None) -> list:
        """:meth:`generate`, each a :class:`weight_transfer.sync.versions.Generation` (vLLM's own
        per-span weight versions)."""
        with self._generating:
            return self.link.generate_tagged(prompts, max_new_tokens, temperature=temperature,
                                             seed=seed)

    def sample(self, prompts: list[list[int]], params: dict) -> list[list[dict]]:
        """Your full ``SamplingParams`` (a dict): per prompt its choices, with logprobs and
        weight-version spans (:func:`weight_transfer.engines.vllm.sampling.sample`)."""
        from weight_transfer.engines.vllm.sampling import sample

        with self._generating:
            return sample(self.link, prompts, params)

    def collective_rpc(self, fn: Any, args: tuple = ()) -> list:
        """Run ``fn(worker, *args)`` in every worker (tests: the oracle), through the link:
        an offline ``LLM``'s or an ``AsyncLLM``'s."""
        return self.link.collective_rpc(fn, args=args)

    def wt_lora(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """A LoRA adapter this replica serves (``enable_lora``, ``max_loras`` >= 2): the
        adapter ``name``'s :class:`~weight_transfer.engines.vllm.lora.link.LoraLink` method
        (one of :data:`LORA_METHODS`; ``setup`` first), over this owner's link: an
        offline ``LLM``'s, an ``AsyncLLM``'s or a ``vllm serve`` server's::

            metas = ray.get(owner.wt_lora.remote("policy", "setup", describe_peft(model)))
            slot = ray.get(owner.wt_lora.remote("policy", "begin", base_version))
            ...   # the trainers write_adapter(nic, metas[r], slot, ...) one-sided
            ray.get(owner.wt_lora.remote("policy", "flip", 3))   # at a step boundary
        """
        if self._loras is None:
            self._loras = AttachedLoras()
        return self._loras.call(self, name, method, args, kwargs)

    def startup_seconds(self) -> float:
        return self.start_seconds

    def shutdown(self) -> None:
        """Close our backend's NICs; stop vLLM's engine processes if we started them (a
        user's engine or server keeps running), and remove the shared memory they leave."""
        try:
            self.link.close()
        finally:
            if self.owns_engine:
                stop_and_remove(self.link.llm.llm_engine.engine_core.shutdown)


# What ``wt_lora`` runs on an adapter: LoraLink's methods, and "version" (the one served).
LORA_METHODS = frozenset({"setup", "request", "begin", "flip", "discard", "rollback", "close",
                          "generate_tagged", "version"})


class AttachedLoras:
    """The LoRA adapters one engine serves: a LoraLink per name over its owner's link
    (:meth:`VllmEngineOwner.wt_lora`, and the user-actor mixins' ``wt_lora`` of
    :mod:`actors.vllm.handle`)."""

    def __init__(self) -> None:
        self.links: dict[str, Any] = {}
        self._lock = threading.Lock()

    def call(self, owner: VllmEngineOwner | None, name: str, method: str, args: tuple,
             kwargs: dict) -> Any:
        if owner is None:
            raise RuntimeError("wt_lora: call self.wt_attach_vllm(engine, replica=...) first")
        if method not in LORA_METHODS:
            raise ValueError(f"wt_lora: unknown method {method!r}; known: "
                             f"{sorted(LORA_METHODS)}")
        if method == "setup":
            return self.setup(owner, name, *args, **kwargs)
        lora = self.links.get(name)
        if lora is None:
            raise ValueError(f"wt_lora: no adapter {name!r} set up on {owner.replica} (set up: "
                             f"{sorted(self.links)}); call wt_lora({name!r}, 'setup', adapter)")
        if method == "version":
            return lora.version
        out = getattr(lora, method)(*args, **kwargs)
        if method == "close":
            with self._lock:
                self.links.pop(name, None)
        return out

    def setup(self, owner: VllmEngineOwner, name: str, adapter: Any, *,
              lora_int_id: int = 1) -> list:
        """Set ``name`` up on every TP rank (after the replica's full-weight registration,
        whose NICs and connections it shares); one LoraRankMeta per rank."""
        from weight_transfer.engines.vllm.lora.link import LoraLink

        with self._lock:
            lora = self.links.get(name)
            if lora is not None and lora.lora_int_id != lora_int_id:
                raise ValueError(f"wt_lora: adapter {name!r} is served under id "
                                 f"{lora.lora_int_id}, not {lora_int_id} (close it first)")
            lora = lora or LoraLink(owner.link, name=name, lora_int_id=lora_int_id)
            for rank in range(owner.tp):
                owner.wt_engine_meta(rank)  # the NICs the adapter's slots are registered on
            metas = lora.setup(adapter, nics=owner.nics, replica=owner.replica,
                               node=ray.get_runtime_context().get_node_id(),
                               address=this_host().address)
            self.links[name] = lora
            return metas


class _Ranked:
    """An owner's method called for one rank: ``.remote(*args)`` is
    ``owner.<method>.remote(rank, *args)``."""

    __slots__ = ("method", "rank")

    def __init__(self, method: Any, rank: int) -> None:
        self.method, self.rank = method, rank

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.method.remote(self.rank, *args, **kwargs)


class OwnerMethod:
    """A :class:`VllmRank` attribute: the owner's method of the same name, given the rank
    (``ranked``) or not (a replica-wide call such as ``generate``)."""

    def __init__(self, ranked: bool = True) -> None:
        self.ranked, self.name = ranked, ""

    def __set_name__(self, cls: type, name: str) -> None:
        self.name = name

    def __get__(self, rank: Any, cls: type | None = None) -> Any:
        if rank is None:
            return self
        method = getattr(rank.owner, self.name)
        return _Ranked(method, rank.rank) if self.ranked else method


class VllmRank:
    """TP rank ``rank`` of a vLLM replica as the controller's engine rank: a plain
    (picklable) object over the replica's owner actor, no actor of its own. Each method is
    the owner's, called with the rank: ``rank.wt_pause.remote(60.0, epoch=3)`` is
    ``owner.wt_pause.remote(rank.rank, 60.0, epoch=3)``, one Ray call. It implements
    :class:`~weight_transfer.engines.rank.EngineRank` and
    :class:`~weight_transfer.engines.rank.ShadowEngineRank` (the owner's ``wt_*`` methods).
    ``generate``/``generate_tagged`` are the replica's (tests, the tools)."""

    __slots__ = ("owner", "rank")

    def __init__(self, owner: Any, rank: int) -> None:
        self.owner, self.rank = owner, rank

    def __reduce__(self) -> tuple:
        return (type(self), (self.owner, self.rank))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank})"

    wt_engine_meta = OwnerMethod()
    wt_host = OwnerMethod()
    wt_node_id = OwnerMethod()
    wt_endpoints = OwnerMethod()
    wt_connect_peers = OwnerMethod()
    wt_pause = OwnerMethod()
    wt_resume = OwnerMethod()
    wt_set_version = OwnerMethod()
    wt_version = OwnerMethod()
    wt_paused = OwnerMethod()
    wt_events = OwnerMethod()
    wt_checksum = OwnerMethod()
    wt_copy_to = OwnerMethod()
    wt_nic_stats = OwnerMethod()
    wt_transport = OwnerMethod()
    wt_close = OwnerMethod()
    wt_shadow_setup = OwnerMethod()
    wt_shadow_info = OwnerMethod()
    wt_stage = OwnerMethod()
    wt_flip = OwnerMethod()
    wt_rollback = OwnerMethod()
    wt_discard_shadow = OwnerMethod()
    wt_live_checksum = OwnerMethod()
    wt_delta_arena = OwnerMethod()
    wt_delta_apply = OwnerMethod()
    generate = OwnerMethod(ranked=False)
    generate_tagged = OwnerMethod(ranked=False)


VllmEngine = ray.remote(max_concurrency=8)(VllmEngineOwner)


def launch_vllm_engines(config: TransferConfig, model_path: str, *, dtype: str = "float32",
                        replicas: list[int] | None = None, env: dict[str, str] | None = None,
                        rank_cls: Any = None, trainers: Any = None,
                        engine_args: dict[str, Any] | None = None) -> Launched:
    """One vLLM engine per replica of the cluster: a handle that is the list of replicas
    (each its TP ranks' :class:`VllmRank` handles) and owns the engines (``.owners``, shut down
    by ``close()``; all closed when an engine fails to start). ``trainers``: the
    trainer actors, if started: their count is checked against the cluster before any vLLM
    starts (ClusterMismatchError naming both). ``engine_args``: vLLM engine arguments
    (``max_model_len``, ``gpu_memory_utilization``, a tokenizer ...) over the small defaults
    (:data:`~weight_transfer.engines.vllm.driver.SMALL_ENGINE`)."""
    check_actors(config.require("launch_vllm_engines", ("cluster",)).cluster,
                 trainers=trainers)
    reps = list(range(config.cluster.inference.replicas)) if replicas is None else replicas
    # env reaches the owner's process before it imports vLLM (its logging reads it then)
    opts = {"num_cpus": 0, **({"runtime_env": {"env_vars": dict(env)}} if env else {})}
    owners = [VllmEngine.options(**opts).remote(config, r, str(model_path), dtype=dtype, env=env,
                                                engine_kw=engine_args)
              for r in reps]
    try:
        ray.get([o.startup_seconds.remote() for o in owners])
    except BaseException:
        Launched([], owners=owners, what="vLLM engines").close()
        raise
    tp = config.cluster.inference.gpus_per_replica
    rank_cls = rank_cls or VllmRank  # tests: actors.tools.testkit.hooks.FaultyVllmRank
    ranks = [ReplicaRanks(rank_cls(o, r) for r in range(tp)) for o in owners]
    return Launched(ranks, actors=[], owners=owners, what="vLLM engines")


def save_trainer_checkpoint(trainers: list[Any], path: Path) -> Path:
    """The trainers' current weights as a Hugging Face checkpoint at ``path``: what vLLM
    engines start from. ``trainers``: every rank's actor, any actor with
    :class:`~actors.trainer.TrainerMixin` (a collective: rank 0 writes,
    :meth:`~actors.trainer.TrainerMixin.wt_save_checkpoint`)."""
    saved = ray.get([t.wt_save_checkpoint.remote(str(path)) for t in trainers])
    if sum(saved) != 1:
        raise RuntimeError(f"{sum(saved)} trainer ranks saved a checkpoint, expected 1")
    return path
