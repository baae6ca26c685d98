"""Connection set-up between trainer and engine NICs, as the controller runs it.

Which NIC pairs connect (:func:`plan_links`: each trainer rank's NIC to every
NIC of the engine ranks of the replicas its plan writes; :func:`copy_links`: a
source replica's NICs to a new replica's, for ``add_replica``), whether the
configured transport reaches them (:meth:`Connector.check`, by hostname and
address: simnic stays on one host), and the two rounds of the two-way exchange
of :mod:`weight_transfer.transport.handshake` over Ray
(:meth:`Connector.connect`): round 1 asks every actor at once for its peer
infos, round 2 sends each side the other side's, to the trainers together with
their plan. Only ``InfoRequest``, ``PeerInfo`` and ``Connection`` records cross
Ray::

    conn = Connector(spec, call=ledger.call, gather=calls.gather)
    metas = conn.gather_engines(engine_actors, label="engine actor")   # and their hosts
    conn.check_engines(trainer_ranks, metas)     # ValueError naming actors and hosts
    links = plan_links(rank_infos, summary.replicas_by_rank, engines_by_replica)
    conn.connect(links, phase="...", rank_infos=rank_infos,
                 trainer_call=lambda rank, conns: ...)  # round 1, then round 2 with the plan
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from actors.groups import node_ip
from weight_transfer.integrity.receipt import check_engine_meta
from weight_transfer.transport.handshake import (
    Connection,
    Endpoint,
    HostId,
    Link,
    requests_by_owner,
    route_answers,
    unreachable_links,
    unreachable_message,
)
from weight_transfer.transport.options import TransportSpec
from weight_transfer.types import EngineRankMeta, RankInfo, RegionDesc


def trainer_owner(rank: int) -> str:
    """The owner name of trainer rank ``rank``'s NIC (its regions and peer infos)."""
    return f"trainer{rank}"


def this_host() -> HostId:
    """The host of the calling process: hostname and the address Ray reaches it at."""
    return HostId(hostname=socket.gethostname(), address=node_ip())


def engine_endpoints(meta: EngineRankMeta) -> list[Endpoint]:
    """The distinct NICs an engine rank registered its regions on, in first-use order."""
    regions: Iterable[RegionDesc] = (t.region for t in meta.tensors)
    return list(dict.fromkeys(Endpoint(owner=r.owner, nic=r.nic) for r in regions))


def plan_links(rank_infos: Sequence[RankInfo], replicas_by_rank: Mapping[int, Sequence[str]],
               engines: Mapping[str, Sequence[EngineRankMeta]],
               regions_by_rank: Mapping[int, Sequence[tuple[str, str, int]]] | None = None,
               ) -> list[Link]:
    """Every (trainer NIC, engine NIC) pair the plan writes through; with
    ``regions_by_rank`` (``PlanSummary.regions_by_rank``) each link grants the writer
    the regions of that engine NIC its plan writes into."""
    links = []
    for info in rank_infos:
        writer = Endpoint(owner=trainer_owner(info.rank), nic=info.nic)
        regions = None if regions_by_rank is None else regions_by_rank.get(info.rank, ())
        for replica in replicas_by_rank.get(info.rank, ()):
            for meta in engines[replica]:
                links += [Link(writer=writer, target=t, grants=_grants(regions, t))
                          for t in engine_endpoints(meta)]
    return links


def _grants(regions: Sequence[tuple[str, str, int]] | None, target: Endpoint
            ) -> tuple[int, ...] | None:
    if regions is None:
        return None
    return tuple(addr for owner, nic, addr in regions if (owner, nic) == (target.owner,
                                                                          target.nic))


def copy_links(src: Sequence[EngineRankMeta], dst: Sequence[EngineRankMeta]) -> list[Link]:
    """The pairs ``wt_copy_to`` writes through: rank r's i-th NIC of ``src`` to that of ``dst``."""
    links = []
    for s, d in zip(src, dst, strict=True):
        regions = list(dict.fromkeys((t.region.owner, t.region.nic, t.region.addr)
                                     for t in d.tensors))
        links += [Link(writer=a, target=b, grants=_grants(regions, b)) for a, b in
                  zip(engine_endpoints(s), engine_endpoints(d), strict=True)]
    return links


class Connector:
    """The controller's side of the connection set-up; see the module docstring.

    ``owners`` maps every NIC owner name (``trainer3``, ``engine0/tp1``) to its
    actor, ``hosts`` to its host; ``links`` are the pairs connected so far.
    """

    def __init__(self, spec: TransportSpec, *, call: Callable[..., Any],
                 gather: Callable[..., list], apply: str = "in_place") -> None:
        self.spec, self._call, self._gather = spec, call, gather
        self.apply = apply  # the controller's TransferConfig.apply
        self.owners: dict[str, Any] = {}
        self.hosts: dict[str, HostId] = {}
        self.links: set[Link] = set()
        self._trainer_owners: set[str] = set()

    def add_trainer(self, rank: int, actor: Any, host: HostId | None) -> None:
        self.owners[trainer_owner(rank)] = actor
        self.hosts[trainer_owner(rank)] = host
        self._trainer_owners.add(trainer_owner(rank))

    def add_engine(self, meta: EngineRankMeta, actor: Any) -> None:
        self.owners.update({ep.owner: actor for ep in engine_endpoints(meta)})

    def drop_engine(self, meta: EngineRankMeta, *, keep_links: bool = False) -> None:
        """Forget an engine rank's NICs and (unless ``keep_links``: the same actor comes
        back at once) the links to and from them, so a later one connects again."""
        owners = {ep.owner for ep in engine_endpoints(meta)}
        for owner in owners:
            self.owners.pop(owner, None)
        if not keep_links:
            self._forget_links(owners)

    def drop_trainers(self) -> None:
        """Forget every trainer rank and its links (new trainer actors connect again)."""
        owners, self._trainer_owners = self._trainer_owners, set()
        for owner in owners:
            self.owners.pop(owner, None)
            self.hosts.pop(owner, None)
        self._forget_links(owners)

    def _forget_links(self, owners: set[str]) -> None:
        self.links = {k for k in self.links
                      if k.writer.owner not in owners and k.target.owner not in owners}

    def gather_engines(
        self, actors: Sequence[Any], *, label: str, phase: str | None = None
    ) -> list[EngineRankMeta]:
        """Engine metadata (buffers registered with NICs of this transport) and each
        engine's host, in one round; the hosts are recorded."""
        n = len(actors)
        refs = ([self._call(a.wt_engine_meta, self.spec) for a in actors]
                + [self._call(a.wt_host) for a in actors])
        labels = [f"{label} {i}" for i in range(n)] * 2
        out = self._gather(refs, labels, phase=phase or f"gather {label} metadata")
        for i, meta in enumerate(out[:n]):  # on receipt: regions, tensors, sizes, dtypes
            where = f"{label} {i} ({getattr(meta, 'replica', '?')}/tp{getattr(meta, 'rank', '?')})"
            check_engine_meta(meta, where)
            self.check_apply(meta, where)
        for meta, host in zip(out[:n], out[n:], strict=True):
            for ep in engine_endpoints(meta):
                self.hosts[ep.owner] = host
        return out[:n]

    def check_apply(self, meta: EngineRankMeta, where: str) -> None:
        """ValueError if this controller updates in place and ``meta`` registers a copy
        served only after a flip (``EngineRankMeta.served_by_flip``: an engine rank keeps
        the shadow a shadow-mode set-up gave it): every update would report success while
        the engine served the old weights."""
        if self.apply == "in_place" and meta.served_by_flip:
            raise ValueError(
                f"{where}: its registered memory is a shadow copy served only after a flip (an "
                "earlier controller set it up with apply='shadow'; the engine keeps it), so an "
                "in-place update would write memory that never serves: set "
                "TransferConfig.apply='shadow' for these engines, or start new engine actors")

    def check(self, pairs: Iterable[tuple[str, str]], *, what: str) -> None:
        """ValueError naming the transport, the actors and their hosts for pairs it cannot
        reach (checked at setup, before any NIC connects)."""
        pairs = list(pairs)
        unknown = sorted({o for pair in pairs for o in pair if self.hosts.get(o) is None})
        if unknown:
            raise ValueError(f"{what}: no host reported by {unknown}")
        bad = unreachable_links(self.spec, self.hosts, pairs)
        if bad:
            raise ValueError(unreachable_message(self.spec, self.hosts, bad,
                                                 field=f"TransferConfig.transport ({what})"))

    def check_engines(self, trainers: Sequence[int], engines: Sequence[EngineRankMeta],
                      sources: Sequence[EngineRankMeta] = ()) -> None:
        """Every trainer rank must reach ``engines``; ``sources`` (a peer replica) too."""
        targets = list(dict.fromkeys(ep.owner for m in engines for ep in engine_endpoints(m)))
        self.check([(trainer_owner(r), t) for r in trainers for t in targets],
                   what="trainer -> engine")
        if sources:
            self.check([(k.writer.owner, k.target.owner) for k in copy_links(sources, engines)],
                       what="replica copy")

    def ask(self, links: Iterable[Link],
            kwargs: Mapping[str, dict] | None = None) -> dict[str, tuple[Connection, ...]]:
        """Round 1 for the links not connected yet, every actor at once; routed answers."""
        new = list(dict.fromkeys(link for link in links if link not in self.links))
        requests = requests_by_owner(new)
        owners = list(requests)
        missing = [o for o in owners if o not in self.owners]
        if missing:
            raise ValueError(f"connection set-up: no actor for NIC owners {missing}")
        if not owners:
            return {}
        kwargs = kwargs or {}
        refs = [self._call(self.owners[o].wt_endpoints, requests[o], **kwargs.get(o, {}))
                for o in owners]
        answers = self._gather(refs, owners, phase=f"connection set-up over {self.spec.kind}: "
                                                  "endpoint info (round 1)")
        return route_answers(requests, dict(zip(owners, answers, strict=True)))

    def connect(self, links: Sequence[Link], *, phase: str,
                rank_infos: Sequence[RankInfo] = (),
                trainer_call: Callable[[int, tuple[Connection, ...]], Any] | None = None) -> None:
        """Both rounds for ``links``; round 2 reaches every side at once: each trainer rank
        through ``trainer_call(rank, conns)`` when given, every other owner through
        ``wt_connect_peers``."""
        kwargs = {trainer_owner(i.rank): {"rank_info": i, "transport": self.spec}
                  for i in rank_infos}
        routed = self.ask(links, kwargs)
        refs, labels = [], []
        if trainer_call is not None:
            for info in rank_infos:
                refs.append(trainer_call(info.rank, routed.pop(trainer_owner(info.rank), ())))
                labels.append(f"trainer rank {info.rank}")
        for owner, conns in routed.items():
            refs.append(self._call(self.owners[owner].wt_connect_peers, list(conns)))
            labels.append(owner)
        if refs:
            self._gather(refs, labels, phase=phase)
        self.links.update(links)
