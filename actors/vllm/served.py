"""vLLM servers (``vllm serve``) as replicas of the controller, driven through vLLM's RL routes.

The servers are the user's (or started by :class:`~weight_transfer.engines.vllm.server.VllmServer`),
each with our backend and the key the controller holds::

    key = new_key()       # WT_VLLM_KEY=<key> VLLM_SERVER_DEV_MODE=1 vllm serve MODEL
                          #   --weight-transfer-config '{"backend": "wt_onesided"}'
                          #   --middleware weight_transfer.engines.vllm.guard.RouteGuard
    with connect_vllm_servers(cfg, ["http://10.0.0.7:8000"], key=key,
                              pause_mode="keep") as replicas:
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        ctl.setup()
        ctl.update(version=1)    # /pause?mode=keep, /start_weight_update, one-sided writes,
                                 # /finish_weight_update {"weight_version": "1"}, /resume

Each server gets one owner actor (:class:`VllmServedOwner`, the vLLM owner over an
:class:`~weight_transfer.engines.vllm.http_link.HttpLink`) and one ``VllmRank``
handle per TP rank, as :func:`actors.vllm.engine.launch_vllm_engines` gives:
the controller is unchanged. The backend's replies come back on an
authenticated channel the owner listens on (:mod:`weight_transfer.engines.vllm.channel`),
at ``reply_host``: the address the servers reach the owner's node at (default:
the node address Ray reports). Closing the handle closes our backend in the
servers and the actors; the servers keep serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from actors.config import TransferConfig
from actors.connections import this_host
from actors.controller.live_config import check_actors
from actors.ready.handles import Launched, ReplicaRanks
from actors.vllm.engine import VllmEngineOwner, VllmRank
from actors.vllm.handle import config_for_link


class VllmServedOwner(VllmEngineOwner):
    """One served replica: an :class:`HttpLink` to the server, the owner's fence and calls."""

    def __init__(self, config: TransferConfig, replica: int, url: str, *, key: str,
                 pause_mode: str = "keep", reply_host: str | None = None,
                 recompute: bool = True, allow_unguarded: bool = False) -> None:
        from weight_transfer.engines.vllm.http_link import HttpLink

        link = HttpLink(url, key=key, reply_host=reply_host or this_host().address,
                        pause_mode=pause_mode, recompute=recompute)
        try:
            link.check_guard(allow_unguarded=allow_unguarded)
        except BaseException:
            link.box.close()
            raise
        super().__init__(config_for_link(config, replica, link), replica, link=link)
        self.url = url

    def sample(self, prompts: list[list[int]], params: dict) -> list[list[dict]]:
        """Your full ``SamplingParams`` (a dict), streamed from the server: per prompt its
        choices, as :func:`weight_transfer.engines.vllm.sampling.sample` gives them."""
        from weight_transfer.engines.vllm.stream import stream_generate

        return [[{"token_ids": list(c.token_ids), "logprobs": list(c.logprobs),
                  "finish_reason": c.finish_reason,
                  "weight_versions": [(s.version, s.start, s.end) for s in c.spans]}
                 for c in stream_generate(self.url, p, params)] for p in prompts]

    def weight_info(self) -> str:
        return self.link.version()


VllmServed = ray.remote(max_concurrency=8)(VllmServedOwner)


def connect_vllm_servers(config: TransferConfig, urls: Sequence[str], *, key: str,
                         pause_mode: str = "keep", reply_host: str | None = None,
                         recompute: bool = True, trainers: Any = None,
                         allow_unguarded: bool = False) -> Launched:
    """One replica per server URL (replica ``i`` is ``urls[i]``): a handle of the replicas'
    ``VllmRank`` handles that owns the owner actors; see the module docstring. ``pause_mode``:
    vLLM's ``abort``, ``wait`` or ``keep``. With no cluster in ``config``, each replica's TP is
    the server's own and the controller derives the cluster from the actors at setup; with
    one, the servers are checked against it. Each server must run our route guard
    (``--middleware weight_transfer.engines.vllm.guard.RouteGuard``) and accept ``key``;
    RuntimeError naming the server otherwise, unless ``allow_unguarded=True`` (a server
    started without the guard, its RL routes open to anyone: logged as a warning)."""
    if not urls:
        raise ValueError("connect_vllm_servers needs at least one server URL")
    cluster = config.cluster
    if cluster is not None:
        check_actors(cluster, trainers=trainers)
    if cluster is not None and len(urls) != cluster.inference.replicas:
        from scheduling.cluster.defaults import ClusterMismatchError

        raise ClusterMismatchError(
            f"{len(urls)} vLLM server URLs, the cluster ({cluster.source or cluster.name}) "
            f"has {cluster.inference.replicas} replicas", field="inference.replicas",
            expected=cluster.inference.replicas, actual=len(urls))
    owners = [VllmServed.options(num_cpus=0).remote(config, i, url, key=key,
                                                    pause_mode=pause_mode, reply_host=reply_host,
                                                    recompute=recompute,
                                                    allow_unguarded=allow_unguarded)
              for i, url in enumerate(urls)]
    try:
        ray.get([o.startup_seconds.remote() for o in owners])
    except BaseException:
        Launched([], owners=owners, what="vLLM servers").close()
        raise
    tps = ray.get([o.__ray_call__.remote(lambda self: self.tp) for o in owners])
    ranks = [ReplicaRanks(VllmRank(o, r) for r in range(tp))
             for o, tp in zip(owners, tps, strict=True)]
    return Launched(ranks, actors=[], owners=owners, what="vLLM servers")
