"""Ray actors for a real vLLM engine: one owner per replica, one facade per TP rank.

``VllmEngine`` owns a vLLM ``LLM`` (with our weight-transfer backend) and its
:class:`~weight_transfer.engines.vllm.driver.VllmLink`; vLLM runs the TP
workers itself. :class:`WeightTransferController` addresses one actor per
(replica, TP rank), so each rank gets a ``VllmRank`` facade that forwards the
controller's calls (``wt_engine_meta``, ``wt_endpoints``, ``wt_connect_peers``,
``wt_pause``, ``wt_resume``, ``wt_set_version``, ``wt_checksum``, ``wt_copy_to`` ...) to the
owner, naming its rank. The controller is used unchanged::

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
The facade is an :class:`~weight_transfer.engines.rank.EngineRank` and a
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
from actors.vllm.shm import engine_segments, remove_unmapped
from weight_transfer.engines.fence import KEEP, CommandFence


class VllmEngineOwner:
    """One replica: the ``LLM``, its workers' NICs (through our backend), pause/resume."""

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
        from weight_transfer.engines.vllm.driver import SMALL_ENGINE, VllmLink

        if model_path is None:
            raise ValueError(f"{self.replica}: give model_path (an engine to start) or link")
        os.environ.update(env or {})  # read by vLLM's processes, e.g. its CPU thread binding
        if self.tp > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(self.tp))))
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        llm = LLM(model=model_path, dtype=dtype, tensor_parallel_size=self.tp,
                  weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME),
                  distributed_executor_backend="mp" if self.tp > 1 else None,
                  **{**SMALL_ENGINE, **(engine_kw or {})})
        return VllmLink(llm)

    def engine_meta(self, rank: int, transport: Any = None, apply: str | None = None):
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

    # ------------------------------------------------------------------ shadow mode

    def shadow_setup(self, rank: int, transport: Any = None):
        self.engine_meta(rank, transport, apply="shadow")
        return self.shadow.info(rank)

    def shadow_info(self, rank: int):
        if getattr(self.link, "apply", "in_place") != "shadow":
            from weight_transfer.engines.shadow.store import ShadowError

            raise ShadowError(f"{self.replica}: shadow mode is not set up on this vLLM engine "
                              "(wt_shadow_setup() first)")
        return self.shadow.info(rank)

    def stage(self, version: Any, epoch: int | None = None) -> bool:
        return self.shadow.stage(version, epoch)

    def flip(self, version: Any, epoch: int | None = None, deadline: float | None = None
             ) -> bool:
        return self.shadow.flip(version, epoch, deadline)

    def rollback(self, epoch: int | None = None, deadline: float | None = None) -> bool:
        return self.shadow.rollback(epoch, deadline)

    def discard_shadow(self, epoch: int | None = None) -> bool:
        return self.shadow.discard(epoch)

    def step_times(self, since: float = 0.0) -> list[float]:
        """Wall-clock times (``time.time()``) of vLLM's engine steps that produced tokens
        since ``since`` (vLLM stamps them with the host-wide monotonic clock)."""
        clock = getattr(self.link, "clock", None)
        if clock is None:
            raise ValueError(f"{self.replica}: {type(self.link).__name__} does not time vLLM's "
                             "engine steps (VllmLink does)")
        offset = time.time() - time.monotonic()
        return [t + offset for t in clock.times() if t + offset >= since]

    def call(self, op: str, request: Any, rank: int) -> Any:
        self.engine_meta(rank)
        return self.link.call(op, request, rank=rank)[0]

    def pause(self, timeout_s: float = 60.0, epoch: int | None = None) -> bool:
        """Stop at a step boundary (once per replica); a fenced pause makes the version held
        None until a resume names one. False: a stale command, ignored."""

        def stop() -> None:
            self._resumed.clear()
            if not self.link.gate.paused:  # the replica's first rank to ask stops it
                self.link.pause(timeout_s)
                self.fence.record("pause")

        return self.fence.pause(epoch, stop)

    def resume(self, rank: int, version: Any = KEEP, epoch: int | None = None,
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

    def set_version(self, version: Any, epoch: int | None = None) -> bool:
        return self.fence.set_version(version, epoch, apply=self.link.set_version)

    def version(self) -> Any:
        return self.fence.version

    def vllm_version(self) -> str:
        return self.link.version()

    def paused(self) -> bool:
        return self.link.gate.paused

    def events(self) -> list:
        return self.fence.events()

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
        with self._generating:  # the TP ranks' facades may ask at once
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
        """Run ``fn(worker, *args)`` in every worker (tests: the oracle)."""
        return self.link.llm.collective_rpc(fn, args=args)

    def startup_seconds(self) -> float:
        return self.start_seconds

    def shutdown(self) -> None:
        """Close our backend's NICs; stop vLLM's engine processes if we started them (a
        user's engine or server keeps running), and remove the shared memory they leave."""
        try:
            self.link.close()
        finally:
            if self.owns_engine:
                segments = engine_segments()  # while its processes still run
                self.link.llm.llm_engine.engine_core.shutdown()
                remove_unmapped(segments)


class VllmRankFacade:
    """The controller's engine-rank interface for TP rank ``rank`` of an owner."""

    def __init__(self, owner: Any, rank: int) -> None:
        self.owner, self.rank = owner, rank

    def _get(self, ref: Any) -> Any:
        return ray.get(ref)

    def wt_engine_meta(self, transport: Any = None):
        return self._get(self.owner.engine_meta.remote(self.rank, transport))

    def wt_host(self):
        return this_host()

    def wt_node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def wt_endpoints(self, requests: list) -> tuple:
        return self._get(self.owner.call.remote("endpoints", list(requests), self.rank))

    def wt_connect_peers(self, conns: list) -> int:
        return self._get(self.owner.call.remote("connect", list(conns), self.rank))

    def wt_copy_to(self, dst: Any) -> int:
        return self._get(self.owner.call.remote("copy_to", dst, self.rank))

    def wt_pause(self, timeout_s: float = 60.0, epoch: int | None = None) -> bool:
        return self._get(self.owner.pause.remote(timeout_s, epoch))

    def wt_resume(self, version: Any = KEEP, epoch: int | None = None,
                  deadline: float | None = None) -> bool:
        return self._get(self.owner.resume.remote(self.rank, version, epoch, deadline))

    def wt_set_version(self, version: Any, epoch: int | None = None) -> bool:
        return self._get(self.owner.set_version.remote(version, epoch))

    def wt_version(self) -> Any:
        return self._get(self.owner.version.remote())

    def wt_paused(self) -> bool:
        return self._get(self.owner.paused.remote())

    def wt_events(self) -> list:
        return self._get(self.owner.events.remote())

    def wt_checksum(self, ranges: Any) -> Any:
        """Hashes of (region address, offset, length) rows of this rank's registered memory."""
        return self._get(self.owner.call.remote("checksum", ranges, self.rank))

    # ---- shadow mode (ShadowEngineRank; actors.vllm.shadow)
    def wt_shadow_setup(self, transport: Any = None):
        return self._get(self.owner.shadow_setup.remote(self.rank, transport))

    def wt_shadow_info(self):
        return self._get(self.owner.shadow_info.remote(self.rank))

    def wt_stage(self, version: Any, epoch: int | None = None, base: bool = False) -> bool:
        """``base`` (a delta update) needs no copy here: vLLM's registered memory already
        holds the version served (a flip reprocesses from it; a rollback swaps it with
        the standby; a discard restores it), and the standby is saved at every stage."""
        return self._get(self.owner.stage.remote(version, epoch))

    def wt_flip(self, version: Any, epoch: int | None = None,
                deadline: float | None = None) -> bool:
        return self._get(self.owner.flip.remote(version, epoch, deadline))

    def wt_rollback(self, epoch: int | None = None, deadline: float | None = None) -> bool:
        return self._get(self.owner.rollback.remote(epoch, deadline))

    def wt_discard_shadow(self, epoch: int | None = None) -> bool:
        return self._get(self.owner.discard_shadow.remote(epoch))

    def wt_live_checksum(self, ranges: Any) -> Any:
        """Hashes of the same rows in the version served (vllm shadow: see the backend)."""
        return self._get(self.owner.call.remote("live_checksum", ranges, self.rank))

    def wt_nic_stats(self) -> dict:
        return self._get(self.owner.call.remote("stats", None, self.rank))

    def wt_transport(self) -> str:
        return self.wt_engine_meta().tensors[0].region.transport

    def wt_close(self) -> None:
        self._get(self.owner.call.remote("close", None, self.rank))

    def wt_delta_arena(self, slots: dict) -> Any:
        """Sparse deltas: this rank's delta arena, registered once in its worker."""
        return self._get(self.owner.call.remote("delta_arena", slots, self.rank))

    def wt_delta_apply(self, version: int) -> Any:
        """Sparse deltas: apply ``version``'s records in the worker, in place, before the
        resume's finish_weight_update reprocesses repacked layers."""
        from weight_transfer.engines.delta_rank import held_version

        held = held_version(self._get(self.owner.events.remote()),
                            self._get(self.owner.version.remote()))
        return self._get(self.owner.call.remote("delta_apply", (version, held), self.rank))

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
        """Greedy (or, with ``temperature`` > 0, vLLM-sampled) continuations."""
        return self._get(self.owner.generate.remote(prompts, max_new_tokens, temperature, seed))

    def generate_tagged(self, prompts: list[list[int]], max_new_tokens: int,
                        temperature: float = 0.0, seed: int | None = None) -> list:
        """:meth:`generate` with the weight versions that produced each sequence's tokens."""
        return self._get(self.owner.generate_tagged.remote(prompts, max_new_tokens,
                                                           temperature, seed))


VllmEngine = ray.remote(max_concurrency=8)(VllmEngineOwner)
VllmRank = ray.remote(max_concurrency=8)(VllmRankFacade)


def launch_vllm_engines(config: TransferConfig, model_path: str, *, dtype: str = "float32",
                        replicas: list[int] | None = None, env: dict[str, str] | None = None,
                        rank_cls: Any = None, trainers: Any = None,
                        engine_args: dict[str, Any] | None = None) -> Launched:
    """One vLLM engine per replica of the cluster: a handle that is the list of replicas
    (each its TP ranks' facades) and owns the facades and the engines (``.owners``, shut down
    first by ``close()``; all closed when an engine fails to start). ``trainers``: the
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
    facades = [ReplicaRanks(rank_cls.options(num_cpus=0).remote(o, r) for r in range(tp))
               for o in owners]
    return Launched(facades, owners=owners, what="vLLM engines")


def save_trainer_checkpoint(trainers: list[Any], path: Path) -> Path:
    """The trainers' current weights as a Hugging Face checkpoint at ``path``: what vLLM
    engines start from. ``trainers``: every rank's actor, any actor with
    :class:`~actors.trainer.TrainerMixin` (a collective: rank 0 writes,
    :meth:`~actors.trainer.TrainerMixin.wt_save_checkpoint`)."""
    saved = ray.get([t.wt_save_checkpoint.remote(str(path)) for t in trainers])
    if sum(saved) != 1:
        raise RuntimeError(f"{sum(saved)} trainer ranks saved a checkpoint, expected 1")
    return path
