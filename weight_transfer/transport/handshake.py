"""Two-way connection set-up between NICs of many processes, in one round for all of them.

Every (writer NIC, target NIC) pair that will write is a :class:`Link`. Both
ends of a link tell the other how to reach them, and each end connects: RDMA
RC queue pairs need that (one QP per pair and side, each brought to RTS with
the other's QP number and PSN); simnic and Mooncake take it as well. The
steps, for the whole cluster at once (the controller does 1, 3 and 5; every
process does 2 and 4 on its own NICs):

1. ``requests = requests_by_owner(links)``: for each process (owner), which of
   its NICs must describe itself to which remote NIC (the peer named);
2. ``infos = answer_requests(nics, requests[owner])``: ``peer_info`` of each (on
   the target side of a link, after ``grant``: the regions the plan lets that
   writer write, from ``Link.grants``);
3. ``conns = route_answers(requests, infos)``: each info goes to the NIC it
   was made for, as a :class:`Connection`;
4. ``connect_peers(nics, conns[owner])``: each NIC connects to its peers;
5. nothing else: only these small records cross the control plane.

Each receiver checks what it got before using it (:mod:`weight_transfer.integrity.receipt`):
requests name NICs by strings, peer infos name owner, NIC and the receiving
NIC's transport, endpoints are mappings with string keys; each NIC's
``check_peer(info)`` checks its backend's endpoint fields, for every connection
before any connects.

:func:`unreachable_links` checks, before any NIC is built, that a transport
bound to one host is not asked to reach a peer on another host; hosts are
compared by hostname and address, and the backend class decides
(``reaches`` / ``unreachable_reason``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weight_transfer.integrity.receipt import check_peer_info, check_str
from weight_transfer.transport.options import TransportSpec
from weight_transfer.transport.registry import registered_transports, transport_class
from weight_transfer.types import PeerInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One NIC of one process: ``owner`` names the process, ``nic`` the NIC."""

    owner: str
    nic: str

    def __str__(self) -> str:
        return f"{self.owner}@{self.nic}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A pair of NICs where ``writer`` writes into memory registered on ``target``."""

    writer: Endpoint
    target: Endpoint
    grants: tuple[int, ...] | None = None  # target region addresses the plan gives writer



@dataclass(frozen=True, slots=True, kw_only=True)
class InfoRequest:
    """Ask the local NIC ``nic`` for its ``peer_info`` made for ``remote``."""

    nic: str
    remote: Endpoint
    grants: tuple[int, ...] | None = None  # set for the target side of a link: see Link



@dataclass(frozen=True, slots=True, kw_only=True)
class Connection:
    """Connect the local NIC ``nic`` to ``peer`` (made by that peer for this NIC)."""

    nic: str
    peer: PeerInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class HostId:
    """The host a process runs on, as :func:`unreachable_links` compares it."""

    hostname: str
    address: str

    def __str__(self) -> str:
        return f"{self.hostname} ({self.address})"


def requests_by_owner(links: Iterable[Link]) -> dict[str, tuple[InfoRequest, ...]]:
    """Both ends of every link, grouped by process, in first-seen order, without repeats."""
    out: dict[str, dict[InfoRequest, None]] = {}
    for link in links:
        if link.writer == link.target:
            raise ValueError(f"link from {link.writer} to itself")
        out.setdefault(link.writer.owner, {})[
            InfoRequest(nic=link.writer.nic, remote=link.target)] = None
        out.setdefault(link.target.owner, {})[
            InfoRequest(nic=link.target.nic, remote=link.writer, grants=link.grants)] = None
    return {owner: tuple(reqs) for owner, reqs in out.items()}


def _nic(nics: Mapping[str, Any], name: str, owner: str) -> Any:
    nic = nics.get(name)
    if nic is None:
        raise ValueError(f"{owner}: has no NIC {name!r} (its NICs: {sorted(nics)})")
    return nic


def answer_requests(nics: Mapping[str, Any], requests: Sequence[InfoRequest],
                    *, owner: str = "") -> tuple[PeerInfo, ...]:
    """Process side, step 2: each request's ``peer_info``, in the order asked."""
    for i, r in enumerate(requests):  # on receipt, before any NIC is asked
        where = f"{owner or 'process'}: info request {i}"
        if not isinstance(r, InfoRequest) or not isinstance(r.remote, Endpoint):
            raise ValueError(f"{where} must be an InfoRequest of an Endpoint, not {r!r:.80}")
        for name, value in (("nic", r.nic), ("remote owner", r.remote.owner),
                            ("remote nic", r.remote.nic)):
            check_str(value, f"{where}: {name}")
        if r.grants is not None and not (isinstance(r.grants, tuple) and all(
                type(a) is int and 0 <= a < 2**64 for a in r.grants)):
            raise ValueError(f"{where}: grants must be a tuple of region addresses")
    out = []
    for r in requests:
        nic = _nic(nics, r.nic, owner)
        if r.grants is not None:  # the target side: what the plan lets that writer write
            nic.grant(r.remote.owner, r.remote.nic, r.grants)
        out.append(nic.peer_info(r.remote.owner, r.remote.nic))
    return tuple(out)


def route_answers(requests: Mapping[str, Sequence[InfoRequest]],
                  answers: Mapping[str, Sequence[PeerInfo]]) -> dict[str, tuple[Connection, ...]]:
    """Controller side, step 3: every answer to the NIC it was made for, per process."""
    out: dict[str, list[Connection]] = {}
    for owner, reqs in requests.items():
        infos = answers.get(owner)
        if infos is None or len(infos) != len(reqs):
            got = "nothing" if infos is None else f"{len(infos)} peer infos"
            raise ValueError(f"{owner} was asked for {len(reqs)} peer infos and returned {got}")
        for req, info in zip(reqs, infos, strict=True):
            check_peer_info(info, f"peer info from {owner} for {req.remote}")
            if (info.owner, info.nic) != (owner, req.nic):
                raise ValueError(f"{owner} answered for {info.owner}@{info.nic} where "
                                 f"{owner}@{req.nic} was asked (for {req.remote})")
            out.setdefault(req.remote.owner, []).append(Connection(nic=req.remote.nic, peer=info))
    return {owner: tuple(conns) for owner, conns in out.items()}


def connect_peers(nics: Mapping[str, Any], conns: Sequence[Connection], *,
                  owner: str = "") -> int:
    """Process side, step 4: connect each local NIC to its peers; returns how many.
    Every connection is checked first (ValueError naming it): none connects if one is bad."""
    for i, conn in enumerate(conns):
        where = f"{owner or 'process'}: connection {i}"
        if not isinstance(conn, Connection):
            raise ValueError(f"{where} must be a Connection, not {type(conn).__name__}")
        check_str(conn.nic, f"{where}: nic")
        nic = _nic(nics, conn.nic, owner)
        check_peer_info(conn.peer, f"{where} ({conn.nic})", transport=nic.kind)
        nic.check_peer(conn.peer)  # the backend's endpoint fields
    for conn in conns:
        _nic(nics, conn.nic, owner).connect(conn.peer)
    return len(conns)


def reaches(spec: TransportSpec, src: HostId, dst: HostId) -> bool:
    """Whether a NIC of ``spec`` on ``src`` can write into one on ``dst``."""
    return src == dst or spec.backend.reaches(spec.options, src, dst)


def unreachable_links(spec: TransportSpec, hosts: Mapping[str, HostId],
                      pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (writer owner, target owner) pairs ``spec`` cannot connect, in order."""
    missing = sorted({o for pair in pairs for o in pair if o not in hosts})
    if missing:
        raise ValueError(f"no host known for {missing}")
    return [(w, t) for w, t in pairs if not reaches(spec, hosts[w], hosts[t])]


def unreachable_message(spec: TransportSpec, hosts: Mapping[str, HostId],
                        bad: Sequence[tuple[str, str]], *, field: str, limit: int = 4) -> str:
    """One error naming the transport, the field, the first pairs and their hosts."""
    shown = "; ".join(f"{w} on {hosts[w]} -> {t} on {hosts[t]}" for w, t in bad[:limit])
    more = f" and {len(bad) - limit} more pairs" if len(bad) > limit else ""
    why = spec.backend.unreachable_reason(spec.options)
    return (f"{field}: transport {spec.kind!r} cannot reach across hosts: {shown}{more} "
            f"({why}; choose {_across_hosts()} for actors on several hosts)")


def _across_hosts() -> str:
    """The registered transports whose default options reach other hosts, quoted."""
    a, b = HostId(hostname="a", address="10.0.0.1"), HostId(hostname="b", address="10.0.0.2")
    names = []
    for name in registered_transports():
        try:
            cls = transport_class(name)
        except ValueError:  # a backend that does not load here is not a choice
            continue
        if cls.reaches(cls.Options(), a, b):
            names.append(repr(name))
    return " or ".join(names) or "a transport that reaches other hosts"
