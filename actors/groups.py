"""Key-value stores and gloo process groups for actors, formed over the control plane.

A group's rank 0 hosts a ``TCPStore`` on a free port of its node's address
(the IP Ray reports for that node, :func:`node_ip`, which every node of the
cluster reaches) and reports it; every member then joins a gloo process group
on that store. Ray carries only the (host, port) pair::

    host, port = ray.get(actors[0].wt_host_store.remote())      # rank 0 only
    ray.get([a.wt_join.remote(host, port) for a in actors])     # all ranks at once

The trainers' barriers between mesh groups use a store of ours instead
(:class:`weight_transfer.sync.store.BarrierStore`, which the controller runs in a
process of its own on :func:`node_ip` of the driver), so an existing trainer with
its own process group needs nothing else.

A store listens on exactly the address it advertises (not on every
interface): a client that dials any other address, loopback included, fails
to connect, so a wrong address shows up on one host too.
"""

from __future__ import annotations

import datetime
import logging

import ray
import torch.distributed as dist

from weight_transfer.sync.listen import serve_store

log = logging.getLogger(__name__)



def node_ip() -> str:
    """The address Ray reports for this process's node: the one other nodes reach it by."""
    return ray.util.get_node_ip_address()


def host_store(*, host: str, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server listening on a free port of ``host`` only (read it from ``.port``);
    a wildcard ``host`` is refused (weight_transfer.sync.listen)."""
    return serve_store(host, timeout_s=timeout_s)


def connect_store(host: str, port: int, *, timeout_s: float = 300.0) -> dist.TCPStore:
    """A client of the TCPStore at ``host:port``."""
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"store port must be an integer in (0, 65536), not {port!r}")
    return dist.TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def join_gloo_group(
    store: dist.Store, *, rank: int, world: int, timeout_s: float = 300.0
) -> None:
    """Make this process rank ``rank`` of a gloo default group of ``world`` ranks."""
    if dist.is_initialized():
        raise RuntimeError(
            f"rank {rank}: this process already has a default process group; "
            "one actor holds one rank"
        )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    log.info("rank %d of %d joined its gloo group", rank, world)



class GroupMember:
    """What a ready-made actor needs to form a group: its Ray node and, on rank 0, a store.

    Subclasses set ``self.config`` (with ``setup_timeout_s``) and ``self._store = None``.
    """

    config: object
    _store: dist.TCPStore | None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def host_store(self) -> tuple[str, int]:
        """Group rank 0: serve the group's TCPStore on this node's address; (host, port)."""
        host = node_ip()
        self._store = host_store(host=host, timeout_s=self.config.setup_timeout_s)
        return host, self._store.port
