"""The two-way connection set-up: pure routing tables, then the actors' code path in-process.

The routing (``requests_by_owner``, ``route_answers``) is checked on small
tables. Then the controller's :class:`~actors.connections.Connector` drives
the real ``TrainerMixin`` / ``InferenceMixin`` methods (``wt_endpoints``,
``wt_connect_peers``, ``wt_copy_to``) in this process, with the Ray calls
replaced by direct calls, over the rdma transport on the in-process verbs model
of ``test_rdma_transport`` (RC semantics: a WRITE lands only if both QPs of the
pair were connected to each other) and over simnic: every byte lands exactly.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_rdma_transport import Fabric, fake_verbs, stand_in_plain_verbs

from actors.connections import Connector, copy_links, plan_links, trainer_owner
from actors.inference import InferenceMixin
from actors.tools.testkit.hooks import TrainerFaultHooks
from actors.trainer import TrainerMixin
from weight_transfer.transport.handshake import (
    Connection,
    Endpoint,
    HostId,
    InfoRequest,
    Link,
    answer_requests,
    requests_by_owner,
    route_answers,
)
from weight_transfer.transport.options import parse_transport
from weight_transfer.transport.rdma import transport as rdma
from weight_transfer.types import PeerInfo, RankInfo, ShardSpec

HOST = HostId(hostname="box", address="10.0.0.1")


def ep(owner: str, nic: str = "n0") -> Endpoint:
    return Endpoint(owner=owner, nic=nic)


def info(owner: str, nic: str, made_for: str) -> PeerInfo:
    return PeerInfo(owner=owner, nic=nic, transport="fake", endpoint={"for": made_for})


# ------------------------------------------------------------------------ pure routing


@pytest.mark.parametrize(
    ("links", "want"),
    [
        # one pair: each side describes itself to the other
        ([Link(writer=ep("t0"), target=ep("e0"))],
         {"t0": [("n0", "e0@n0")], "e0": [("n0", "t0@n0")]}),
        # an engine with two NICs: the trainer NIC is asked once per engine NIC
        ([Link(writer=ep("t0"), target=ep("e0", "a")), Link(writer=ep("t0"), target=ep("e0", "b"))],
         {"t0": [("n0", "e0@a"), ("n0", "e0@b")], "e0": [("a", "t0@n0"), ("b", "t0@n0")]}),
        # repeated links are asked once
        ([Link(writer=ep("t0"), target=ep("e0"))] * 3,
         {"t0": [("n0", "e0@n0")], "e0": [("n0", "t0@n0")]}),
        # two trainers, one engine
        ([Link(writer=ep("t0"), target=ep("e0")), Link(writer=ep("t1"), target=ep("e0"))],
         {"t0": [("n0", "e0@n0")], "t1": [("n0", "e0@n0")],
          "e0": [("n0", "t0@n0"), ("n0", "t1@n0")]}),
    ],
)
def test_requests_name_the_peer_on_both_sides(links, want):
    got = requests_by_owner(links)
    assert {o: [(r.nic, str(r.remote)) for r in reqs] for o, reqs in got.items()} == want


def test_requests_refuse_a_link_to_itself():
    with pytest.raises(ValueError, match="link from t0@n0 to itself"):
        requests_by_owner([Link(writer=ep("t0"), target=ep("t0"))])


def test_answers_go_to_the_nic_they_were_made_for():
    links = [Link(writer=ep("t0"), target=ep("e0", "a")),
             Link(writer=ep("t0"), target=ep("e0", "b"))]
    requests = requests_by_owner(links)
    answers = {o: [info(o, r.nic, str(r.remote)) for r in reqs] for o, reqs in requests.items()}
    routed = route_answers(requests, answers)
    assert routed["t0"] == (Connection(nic="n0", peer=info("e0", "a", "t0@n0")),
                            Connection(nic="n0", peer=info("e0", "b", "t0@n0")))
    assert routed["e0"] == (Connection(nic="a", peer=info("t0", "n0", "e0@a")),
                            Connection(nic="b", peer=info("t0", "n0", "e0@b")))


@pytest.mark.parametrize(
    ("answers", "words"),
    [
        ({"e0": [info("e0", "n0", "x")]}, "t0 was asked for 1 peer infos and returned nothing"),
        ({"t0": [], "e0": [info("e0", "n0", "x")]}, "t0 was asked for 1 peer infos and returned 0"),
        ({"t0": [info("t9", "n0", "x")], "e0": [info("e0", "n0", "x")]},
         "t0 answered for t9@n0 where t0@n0 was asked"),
    ],
)
def test_wrong_answers_are_refused_naming_the_actor(answers, words):
    requests = requests_by_owner([Link(writer=ep("t0"), target=ep("e0"))])
    with pytest.raises(ValueError, match=words):
        route_answers(requests, answers)


def test_plan_links_follow_the_replicas_each_rank_writes():
    def meta(replica, rank, nics):
        regions = [SimpleNamespace(region=SimpleNamespace(owner=f"{replica}/tp{rank}", nic=n,
                                                          addr=100 + i))
                   for i, n in enumerate(nics)]
        return SimpleNamespace(tensors=regions)

    engines = {"engine0": [meta("engine0", 0, ["a", "b", "a"])],
               "engine1": [meta("engine1", 0, ["c"])]}
    infos = [RankInfo(rank=0, node="x", nic="t/nic0"), RankInfo(rank=1, node="x", nic="t/nic1")]
    links = plan_links(infos, {0: ("engine0",), 1: ("engine0", "engine1")}, engines)
    assert [(str(k.writer), str(k.target)) for k in links] == [
        ("trainer0@t/nic0", "engine0/tp0@a"), ("trainer0@t/nic0", "engine0/tp0@b"),
        ("trainer1@t/nic1", "engine0/tp0@a"), ("trainer1@t/nic1", "engine0/tp0@b"),
        ("trainer1@t/nic1", "engine1/tp0@c")]
    assert [(str(k.writer), str(k.target)) for k in
            copy_links(engines["engine0"], [meta("engine9", 0, ["x", "y"])])] == [
        ("engine0/tp0@a", "engine9/tp0@x"), ("engine0/tp0@b", "engine9/tp0@y")]
    assert all(k.grants is None for k in links)  # no regions given: no grants


def test_links_grant_each_writer_the_regions_its_plan_writes():
    def meta(replica, nics):
        return SimpleNamespace(tensors=[SimpleNamespace(region=SimpleNamespace(
            owner=f"{replica}/tp0", nic=n, addr=a)) for n, a in nics])

    engines = {"engine0": [meta("engine0", [("a", 10), ("a", 11), ("b", 12)])]}
    infos = [RankInfo(rank=0, node="x", nic="n0"), RankInfo(rank=1, node="x", nic="n1")]
    regions = {0: (("engine0/tp0", "a", 10),), 1: (("engine0/tp0", "a", 11),
                                                    ("engine0/tp0", "b", 12))}
    links = plan_links(infos, {0: ("engine0",), 1: ("engine0",)}, engines, regions)
    assert [(str(k.writer), k.target.nic, k.grants) for k in links] == [
        ("trainer0@n0", "a", (10,)), ("trainer0@n0", "b", ()),
        ("trainer1@n1", "a", (11,)), ("trainer1@n1", "b", (12,))]
    requests = requests_by_owner(links)
    assert {r.grants for r in requests["engine0/tp0"]} == {(10,), (), (11,), (12,)}
    assert all(r.grants is None for r in requests["trainer0"])  # writers grant nothing
    copies = copy_links(engines["engine0"], [meta("engine9", [("x", 20), ("x", 21), ("y", 22)])])
    assert [k.grants for k in copies] == [(20, 21), (22,)]


def test_answer_requests_grants_before_the_peer_info():
    calls = []

    class Nic:
        def grant(self, owner, nic, regions):
            calls.append(("grant", owner, nic, regions))

        def peer_info(self, owner, nic):
            calls.append(("info", owner, nic))
            return PeerInfo(owner="e", nic="t", transport="x")

    reqs = [InfoRequest(nic="t", remote=Endpoint(owner="trainer0", nic="n0"), grants=(5,)),
            InfoRequest(nic="t", remote=Endpoint(owner="engine1/tp0", nic="m"))]
    answer_requests({"t": Nic()}, reqs, owner="e")
    assert calls == [("grant", "trainer0", "n0", (5,)), ("info", "trainer0", "n0"),
                     ("info", "engine1/tp0", "m")]
    with pytest.raises(ValueError, match="grants must be a tuple"):
        answer_requests({"t": Nic()}, [InfoRequest(nic="t", remote=Endpoint(
            owner="w", nic="n"), grants=["x"])], owner="e")


# ------------------------------------------------------------------------ the actors' code path


class BufferAdapter:
    """An engine adapter over plain buffers: what an engine exposes, nothing else."""

    def __init__(self, sizes):
        self.buffers = [np.zeros(n, dtype=np.uint8) for n in sizes]
        self.paused = False

    def region_buffers(self):
        return [(buf, [(f"w{i}", (buf.size,), "uint8", 0)]) for i, buf in enumerate(self.buffers)]


class Engine(InferenceMixin):
    def __init__(self, replica, rank, sizes, nics):
        self.owner, self.adapter = f"{replica}/tp{rank}", BufferAdapter(sizes)
        self.wt_attach_engine(adapter=self.adapter, replica=replica, rank=rank,
                              shard=ShardSpec(tp_rank=rank, tp_size=2), nics=nics)

    def wt_node_id(self) -> str:
        return "node-a"

    def wt_host(self) -> HostId:
        return HOST


class Trainer(TrainerFaultHooks, TrainerMixin):
    def __init__(self, rank, world):
        self.wt_attach(model=torch.nn.Linear(2, 2), rank=rank, world=world)

    def wt_host(self) -> HostId:
        return HOST


def direct_connector(spec) -> Connector:
    """The controller's connector with Ray's call and gather replaced by direct calls."""
    return Connector(spec, call=lambda method, *a, **k: method(*a, **k),
                     gather=lambda refs, labels, phase: list(refs))


def cluster(spec, *, nics_per_engine):
    """2 trainer ranks -> 2 replicas x TP2 engine ranks (with ``nics_per_engine`` NICs each)."""
    conn = direct_connector(spec)
    trainers = [Trainer(r, 2) for r in range(2)]
    infos = [RankInfo(rank=r, node="node-a", nic=f"tnode0/nic{r}") for r in range(2)]
    nics = [f"inic{i}" for i in range(nics_per_engine)]
    replicas = {f"engine{k}": [Engine(f"engine{k}", r, [4096 + 512 * i for i in range(3)], nics)
                               for r in range(2)] for k in range(2)}
    for r, t in enumerate(trainers):
        conn.add_trainer(r, t, t.wt_host())
    metas = {}
    for name, actors in replicas.items():
        metas[name] = conn.gather_engines(actors, label="engine actor")
        for actor, meta in zip(actors, metas[name], strict=True):
            conn.add_engine(meta, actor)
    conn.check_engines([0, 1], [m for ms in metas.values() for m in ms])
    links = plan_links(infos, {0: ("engine0", "engine1"), 1: ("engine0", "engine1")}, metas)
    conn.connect(links, phase="connect", rank_infos=infos)  # trainers: wt_connect_peers
    return conn, trainers, replicas, metas


def write_everything(trainers, metas):
    """Each trainer writes its own pattern into every other region; returns what must land."""
    expected = {}
    jobs = []
    regions = [t.region for ms in metas.values() for m in ms for t in m.tensors]
    for i, region in enumerate(regions):
        trainer = trainers[i % len(trainers)]
        src = np.random.default_rng(i).integers(0, 256, region.length, dtype=np.uint8)
        expected[(region.owner, region.addr)] = src
        jobs.append(trainer.wt_nic.write(src, region, 0))

    async def run():
        await asyncio.gather(*jobs)

    asyncio.run(run())
    return expected


def assert_landed(replicas, expected):
    for actors in replicas.values():
        for actor in actors:
            for buf in actor.adapter.buffers:
                key = (actor.owner, buf.__array_interface__["data"][0])
                assert np.array_equal(buf, expected[key]), key


@pytest.fixture
def fabric(monkeypatch):
    """Every rdma NIC built through the registry opens a device of this in-process model."""
    fab = Fabric(stand_in_plain_verbs())
    monkeypatch.setattr(rdma, "import_pyverbs", lambda: fake_verbs(fab))
    return fab


@pytest.mark.parametrize("nics_per_engine", [1, 2])
def test_rdma_pairs_connect_both_ways_through_the_actor_methods(fabric, nics_per_engine):
    spec = parse_transport("rdma", {"port": 1, "gid_index": 0}, where="test")
    conn, trainers, replicas, metas = cluster(spec, nics_per_engine=nics_per_engine)
    engine_nics = 4 * nics_per_engine
    # One RC QP per (trainer NIC, engine NIC) pair on each side, every one at RTS.
    assert len(fabric.qps) == 2 * (2 * engine_nics)
    assert all(qp.state == 3 for qp in fabric.qps.values())
    for qp in fabric.qps.values():
        assert fabric.qps[qp.dest].dest == qp.qp_num  # each QP is wired to its partner
    expected = write_everything(trainers, metas)
    assert_landed(replicas, expected)
    assert sum(t.wt_nic_stats()["bytes_written"] for t in trainers) == sum(
        v.size for v in expected.values())
    # Connecting again asks nothing: the connector remembers its links.
    before = len(fabric.qps)
    conn.connect(list(conn.links), phase="again", rank_infos=[])
    assert len(fabric.qps) == before


def test_rdma_new_replica_is_filled_from_a_peer_over_its_own_qps(fabric):
    spec = parse_transport("rdma", {}, where="test")
    conn, trainers, replicas, metas = cluster(spec, nics_per_engine=2)
    expected = write_everything(trainers, metas)
    new = [Engine("engine2", r, [4096 + 512 * i for i in range(3)], ["inic0", "inic1"])
           for r in range(2)]
    new_metas = conn.gather_engines(new, label="new engine actor")
    for actor, meta in zip(new, new_metas, strict=True):
        conn.add_engine(meta, actor)
    conn.check_engines([0, 1], new_metas, sources=metas["engine0"])
    conn.connect(copy_links(metas["engine0"], new_metas), phase="copy")
    copied = [src.wt_copy_to(dst) for src, dst in zip(replicas["engine0"], new_metas,
                                                        strict=True)]
    assert copied == [4096 + 4608 + 5120] * 2
    for src, dst in zip(replicas["engine0"], new, strict=True):
        for a, b in zip(src.adapter.buffers, dst.adapter.buffers, strict=True):
            assert np.array_equal(a, b) and a.any()
    assert_landed(replicas, expected)


def test_without_the_engine_side_connecting_rdma_writes_fail():
    """Why two ways: a trainer QP at RTS whose partner never connected delivers nothing."""
    fab = Fabric(stand_in_plain_verbs())
    w = rdma.RdmaTransport(owner="trainer0", nic="t", verbs=fake_verbs(fab))
    t = rdma.RdmaTransport(owner="engine0/tp0", nic="e", verbs=fake_verbs(fab))
    dst = np.zeros(64, dtype=np.uint8)
    desc = t.register(dst)
    w.connect(t.peer_info("trainer0", "t"))  # one way only
    with pytest.raises(rdma.PeerUnreachableError, match="retry exceeded"):
        asyncio.run(w.write(np.ones(64, dtype=np.uint8), desc, 0))
    assert not dst.any()


def test_simnic_pairs_connect_both_ways_and_bytes_land():
    spec = parse_transport("simnic", {"bandwidth_gbps": 50.0}, where="test")
    _, trainers, replicas, metas = cluster(spec, nics_per_engine=2)
    assert_landed(replicas, write_everything(trainers, metas))
    # Faults go through the optional interface; simnic has it.
    trainers[0].wt_set_link(False)
    region = metas["engine0"][0].tensors[0].region
    with pytest.raises(rdma.PeerUnreachableError, match="link"):
        asyncio.run(trainers[0].wt_nic.write(np.ones(8, dtype=np.uint8), region, 0))
    trainers[0].wt_set_link(True)
    asyncio.run(trainers[0].wt_nic.write(np.ones(8, dtype=np.uint8), region, 0))


def test_fault_injection_is_refused_by_a_transport_without_it(fabric):
    spec = parse_transport("rdma", {}, where="test")
    _, trainers, _, _ = cluster(spec, nics_per_engine=1)
    with pytest.raises(TypeError, match=r"NIC trainer0/tnode0/nic0 of transport 'rdma' cannot "
                                        r"inject faults.*only the simulated NIC 'simnic'"):
        trainers[0].wt_set_link(False)
    with pytest.raises(TypeError, match="'rdma' cannot inject faults"):
        trainers[0].wt_fail_after_bytes(10)


def test_an_engine_asked_for_a_nic_it_does_not_have_names_it():
    spec = parse_transport("simnic", {}, where="test")
    engine = Engine("engine0", 0, [4096], ["inic0"])
    engine.wt_engine_meta(spec)
    with pytest.raises(ValueError, match=r"engine0/tp0: has no NIC 'inic7' \(its NICs: \["):
        engine.wt_endpoints([InfoRequest(nic="inic7", remote=ep(trainer_owner(0)))])
    with pytest.raises(ValueError, match="registered with simnic NICs, not rdma"):
        engine.wt_engine_meta(parse_transport("rdma", {}, where="test"))
