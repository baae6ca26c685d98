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

Pause is idempotent over a replica's ranks (the first one stops the engine at a
step boundary); the replica resumes - ``finish_weight_update(version)``, a
prefix-cache reset - when its last rank has called ``wt_resume``. Commands are
fenced by the controller's epochs as for the reference engine's ranks
(:class:`actors.inference.InferenceMixin`): a stale one is ignored, a resume
past its deadline refused (the replica stays paused); one epoch per replica.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray

from actors.config import TransferConfig
from actors.connections import this_host

_KEEP = object()


class VllmEngineOwner:
    """One replica: the ``LLM``, its workers' NICs (through our backend), pause/resume."""

    def __init__(self, config: TransferConfig, replica: int, model_path: str, *,
                 dtype: str = "float32", engine_kw: dict | None = None,
                 env: dict[str, str] | None = None) -> None:
        from weight_transfer.engines.vllm import BACKEND_NAME
        from weight_transfer.engines.vllm.driver import SMALL_ENGINE, VllmLink

        cluster = config.cluster
        self.tp = cluster.inference.gpus_per_replica
        self.config, self.replica = config, cluster.replica_name(replica)
        self.nics = tuple((cluster.engine_rank(replica, r)[1],) for r in range(self.tp))
        os.environ.update(env or {})  # read by vLLM's processes, e.g. its CPU thread binding
        if self.tp > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(self.tp))))
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        t0 = time.perf_counter()
        llm = LLM(model=model_path, dtype=dtype, tensor_parallel_size=self.tp,
                  weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME),
                  distributed_executor_backend="mp" if self.tp > 1 else None,
                  **{**SMALL_ENGINE, **(engine_kw or {})})
        self.start_seconds = time.perf_counter() - t0
        self.link = VllmLink(llm)
        self._metas: list | None = None
        self._lock = threading.Lock()
        self._generating = threading.Lock()  # one generate loop steps the engine at a time
        self._resumed: set[int] = set()
        self._epoch = 0  # the newest controller epoch seen
        self._version: Any = None
        self._events: list[tuple[str, Any, float]] = []

    def engine_meta(self, rank: int, transport: Any = None):
        from weight_transfer.engines.vllm.mailbox import SetupRequest

        with self._lock:
            if self._metas is None:
                spec = transport or self.config.transport_spec
                self._metas = self.link.setup(SetupRequest(
                    replica=self.replica, nics=self.nics, transport=spec,
                    node=ray.get_runtime_context().get_node_id(),
                    address=this_host().address))
            return self._metas[rank]

    def call(self, op: str, request: Any, rank: int) -> Any:
        self.engine_meta(rank)
        return self.link.call(op, request, rank=rank)[0]

    def _fence(self, epoch: int | None, what: str) -> bool:
        """Whether a command of ``epoch`` is current (None: unfenced); under ``_lock``. The
        controller gives every rank of a replica the same epoch, so one is kept per replica
        (as :meth:`actors.inference.InferenceMixin._wt_fence` keeps one per rank)."""
        if epoch is None:
            return True
        if epoch < self._epoch:
            self._events.append((f"stale {what}", self._version, time.time()))
            return False
        self._epoch = epoch
        return True

    def pause(self, timeout_s: float = 60.0, epoch: int | None = None) -> bool:
        """Stop at a step boundary (once per replica); a fenced pause makes the version held
        None until a resume names one. False: a stale command, ignored."""
        with self._lock:
            if not self._fence(epoch, "pause"):
                return False
            if epoch is not None:
                self._version = None
            self._resumed.clear()
            if not self.link.gate.paused:  # the replica's first rank to ask stops it
                self.link.pause(timeout_s)
                self._events.append(("pause", self._version, time.time()))
        return True

    def resume(self, rank: int, version: Any = None, epoch: int | None = None,
               deadline: float | None = None, keep: bool = False) -> bool:
        """Rank ``rank`` is done; the replica resumes (vLLM's finish_weight_update, a prefix
        cache reset) when all its ranks are. False (stays paused): stale, or past
        ``deadline``. ``keep``: no version given (the one held stays)."""
        with self._lock:
            if not self._fence(epoch, "resume"):
                return False
            if deadline is not None and time.time() > deadline:
                self._events.append(("late resume", self._version, time.time()))
                return False
            if not keep:
                self._version = version
            self._resumed.add(rank)
            if len(self._resumed) == self.tp and self.link.gate.paused:
                self.link.resume(None if keep else version)
                self._events.append(("resume", self._version, time.time()))
        return True

    def set_version(self, version: Any, epoch: int | None = None) -> bool:
        with self._lock:
            if not self._fence(epoch, "version"):
                return False
            self._version = version
            self.link.set_version(version)
            self._events.append(("version", version, time.time()))
        return True

    def version(self) -> Any:
        return self._version

    def vllm_version(self) -> str:
        return self.link.version()

    def paused(self) -> bool:
        return self.link.gate.paused

    def events(self) -> list:
        return list(self._events)

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
        with self._generating:  # the TP ranks' facades may ask at once
            return self.link.generate(prompts, max_new_tokens, temperature=temperature,
                                      seed=seed)

    def collective_rpc(self, fn: Any, args: tuple = ()) -> list:
        """Run ``fn(worker, *args)`` in every worker (tests: the oracle)."""
        return self.link.llm.collective_rpc(fn, args=args)

    def startup_seconds(self) -> float:
        return self.start_seconds

    def shutdown(self) -> None:
        """Close our backend's NICs and stop vLLM's engine processes."""
        try:
            self.link.close()
        finally:
            self.link.llm.llm_engine.engine_core.shutdown()


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

    def wt_resume(self, version: Any = _KEEP, epoch: int | None = None,
                  deadline: float | None = None) -> bool:
        keep = version is _KEEP  # the sentinel does not survive pickling: say it
        return self._get(self.owner.resume.remote(self.rank, None if keep else version, epoch,
                                                  deadline, keep))

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

    def wt_nic_stats(self) -> dict:
        return self._get(self.owner.call.remote("stats", None, self.rank))

    def wt_transport(self) -> str:
        return self.wt_engine_meta().tensors[0].region.transport

    def wt_deregister(self) -> None:
        self._get(self.owner.call.remote("deregister", None, self.rank))

    def wt_close(self) -> None:
        self._get(self.owner.call.remote("close", None, self.rank))

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
        """Greedy (or, with ``temperature`` > 0, vLLM-sampled) continuations."""
        return self._get(self.owner.generate.remote(prompts, max_new_tokens, temperature, seed))


VllmEngine = ray.remote(max_concurrency=8)(VllmEngineOwner)
VllmRank = ray.remote(max_concurrency=8)(VllmRankFacade)


def launch_vllm_engines(config: TransferConfig, model_path: str, *, dtype: str = "float32",
                        replicas: list[int] | None = None, env: dict[str, str] | None = None
                        ) -> tuple[list[list[Any]], list[Any]]:
    """(rank facades per replica, owners): one vLLM engine per replica of the cluster."""
    reps = list(range(config.cluster.inference.replicas)) if replicas is None else replicas
    # env reaches the owner's process before it imports vLLM (its logging reads it then)
    opts = {"num_cpus": 0, **({"runtime_env": {"env_vars": dict(env)}} if env else {})}
    owners = [VllmEngine.options(**opts).remote(config, r, str(model_path), dtype=dtype, env=env)
              for r in reps]
    ray.get([o.startup_seconds.remote() for o in owners])
    tp = config.cluster.inference.gpus_per_replica
    facades = [[VllmRank.options(num_cpus=0).remote(o, r) for r in range(tp)] for o in owners]
    return facades, owners
