"""What a launch helper started, owned: its actors, the processes they own, their placement
groups; closed by whoever launched them.

``launch_trainers``, ``launch_engines`` and ``launch_vllm_engines`` return a
:class:`Launched`. It is a read-only sequence of what the caller addresses (the
trainer actors; the replicas, each a list of TP-rank actors), so it goes
wherever a list went (``WeightTransferController(trainers=..., engines=...)``,
``(new,) = launch_engines(cfg, replicas=[2])``), and it closes what it created::

    with launch_trainers(cfg) as trainers, launch_engines(cfg) as replicas:
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        ...
    # every actor killed, every placement group removed

:meth:`Launched.close` first asks the owners (e.g. vLLM's engine actors) to
shut down what they run themselves, then kills every actor and removes the
placement groups; it is idempotent and never raises for an actor that already
died.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import ray

from actors.placement import remove_groups

log = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 60.0


class ReplicaRanks(list):
    """One replica's TP-rank handles, as a :class:`Launched` of engines holds them: a plain
    list, marked so that the controller tells one replica from a list of replicas."""


def check_engines(engines: Any) -> None:
    """TypeError, with the line to write instead, where ``engines`` is one replica's ranks:
    the 0.1.0 shape ``replicas, owners = launch_vllm_engines(...)`` unpacks a Launched of two
    replicas without an error and hands replica 0 over as if it were all of them."""
    if isinstance(engines, ReplicaRanks):
        raise TypeError(
            "engines= got the rank handles of one replica, not a list of replicas. "
            "launch_vllm_engines returns one Launched handle since 0.2.0 (it returned "
            "(facades, owners) before): write `replicas = launch_vllm_engines(...)` and "
            "`engines=replicas` (`replicas.owners` are the engine owners); to pass one "
            "replica, write `engines=[replica]`. See CHANGELOG.md.")


class Launched(Sequence):
    """See the module docstring. ``items``: what indexing and iteration give."""

    def __init__(self, items: Sequence[Any], *, actors: Iterable[Any] | None = None,
                 groups: Iterable[Any] = (), owners: Iterable[Any] = (),
                 what: str = "actors") -> None:
        self._items = list(items)
        self.actors = list(actors) if actors is not None else _flat(self._items)
        self.groups, self.owners, self.what = list(groups), list(owners), what
        self.closed = False

    @classmethod
    def merge(cls, handles: Iterable[Launched], *, what: str = "actors") -> Launched:
        """One handle owning everything ``handles`` own (their items in order)."""
        out = cls([], what=what)
        for h in handles:
            out.absorb(h)
        return out

    def absorb(self, other: Launched) -> None:
        """Take over what ``other`` owns (its items after ours); ``other`` then owns nothing."""
        self._items += other._items
        self.actors += other.actors
        self.groups += other.groups
        self.owners += other.owners
        other._items, other.actors, other.groups, other.owners = [], [], [], []

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return (f"Launched({self.what}: {len(self._items)} items, {len(self.actors)} actors, "
                f"{len(self.owners)} owners, {len(self.groups)} placement groups)")

    @property
    def replicas(self) -> list[Any]:
        """The items (for engines: one list of TP-rank actors per replica)."""
        return list(self._items)

    def close(self, *, timeout_s: float = SHUTDOWN_WAIT_S) -> None:
        """Shut the owners' processes down, kill every actor, remove the placement groups."""
        if self.closed:
            return
        self.closed = True
        refs = [o.shutdown.remote() for o in self.owners]
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("closing %s: an owner did not shut down: %s", self.what, exc)
        for actor in [*self.actors, *self.owners]:
            try:
                ray.kill(actor)
            except (ray.exceptions.RayError, ValueError) as exc:  # already gone
                log.debug("closing %s: %s", self.what, exc)
        remove_groups(self.groups)

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flat(items: Sequence[Any]) -> list[Any]:
    return [a for i in items for a in (i if isinstance(i, list | tuple) else [i])]
