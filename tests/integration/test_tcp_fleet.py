"""A fleet over our authenticated ``tcp`` transport, and what an outsider can do to it.

One fleet of the tiny model (2 trainer ranks -> 2 replicas x TP2: the ``reference-fleet``
group's actors, ``tests/integration/conftest.py``; its controller with encrypted tcp links
and an audit log) serves every test of the module, in order (each fleet start costs tens of
seconds on the 2-core machines):

1. setup gives every engine NIC the regions each trainer NIC may write (from the
   plan) and every trainer NIC a fresh link key; updates land byte-exact (every
   engine byte equals the reference layout of the trainers' weights), nothing is
   refused;
2. what the fleet listens on: for the driver and every actor process the listening
   TCP sockets are read from ``/proc/<pid>/net/tcp{,6}`` and ``/proc/<pid>/fd``.
   Ray's core-worker gRPC server (one per process) binds ``[::]``: that one is Ray's,
   found by its port (the owner address of an object the process puts) and set
   apart; everything else in those processes is ours (the barrier store, the group
   stores, gloo, the tcp targets) and must bind one address, as must the barrier
   store's own process. Mooncake's listeners bind every interface whatever we ask:
   they are Mooncake's, documented in docs/security.md, and not part of this fleet;
3. between updates (engines serving, window closed) a write by a planned writer is
   refused with nothing written; the refusal is counted on the engine and the next
   update's audit line names the engine rank that refused it;
4. a new replica is filled from a peer over engine-to-engine tcp links;
5. an outsider on the live barrier store (torch's stock client, no secret) tries to
   pre-arrive for a rank: refused at the store's handshake, nothing stored; the next
   update passes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch
from outsider.driver import Outsider  # tests/ is on sys.path (its conftest.py)

from actors import WeightTransferController, launch_engines
from actors.controller.audit import read_audit
from actors.tools.testkit.engine_bytes import engine_mismatches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TOKENS = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def fleet(reference_fleet, tmp_path_factory):  # its NICs opened as tcp by this controller
    audit = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    cfg = reference_fleet.config(transport="tcp",
                                 transport_options={"encrypt": True, "chunk_bytes": 1 << 16},
                                 audit_path=audit, barrier_timeout_s=30)
    # What this process listened on before the controller (other modules' leftovers in the
    # same pytest process, e.g. an in-process Mooncake engine's listeners): not the fleet's.
    before = set(listeners(os.getpid()))
    trainers, replicas = reference_fleet.trainers, reference_fleet.replicas
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    summary = ctl.setup()
    yield SimpleNamespace(cfg=cfg, ctl=ctl, summary=summary, trainers=trainers,
                          replicas=list(replicas), handle=replicas, audit=audit,
                          versions=itertools.count(1), driver_before=before)
    ctl.shutdown()


def _stats(replicas):
    return [ray.get(a.wt_nic_stats.remote()) for rep in replicas for a in rep]


def _train_and_update(f) -> int:
    ray.get([t.train_step.remote(TOKENS) for t in f.trainers])
    version = next(f.versions)
    f.ctl.update(version)
    return version


def test_setup_and_updates_over_tcp_are_byte_exact(fleet):
    f = fleet
    assert all(f.summary.regions_by_rank[r] for r in range(len(f.trainers)))
    for _ in range(2):
        ray.get([t.train_step.remote(TOKENS) for t in f.trainers])
        assert f.ctl.update(next(f.versions)).bytes == f.summary.bytes_total
        assert engine_mismatches(f.cfg.model, f.trainers, f.replicas) == []
    assert ray.get([a.wt_transport.remote() for rep in f.replicas for a in rep]) == ["tcp"] * 4
    assert all(s["refused_writes"] == 0 and s["refused_connections"] == 0
               for s in _stats(f.replicas))


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # /proc prints each 32-bit word of an IPv6 address in host (little-endian) order
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip), int(port, 16)


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket that process ``pid`` holds."""
    inodes, out = _socket_inodes(pid), []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                out.append(_address(fields[1]))
    return out


def ours(pid: int, ray_port: int) -> list[tuple[str, int]]:
    return [(a, p) for a, p in listeners(pid) if p != ray_port]


def test_no_listener_of_a_running_fleet_binds_a_wildcard(fleet):
    f = fleet
    assert _address("0100007F:1F90") == ("127.0.0.1", 8080)  # how /proc/net prints them
    assert _address("00000000000000000000000000000000:0050") == ("::", 80)

    def ray_port(_self=None) -> tuple[int, int]:  # nested: Ray ships it by value
        """(pid, port of Ray's core-worker server) of the process this runs in."""
        import os

        import ray
        from ray.core.generated.common_pb2 import Address

        ref = ray.put(0)  # owned by this process: its owner address is this core worker
        core = ray._private.worker.global_worker.core_worker
        return os.getpid(), Address.FromString(core.get_owner_address(ref)).port

    actors = f.trainers.actors + f.handle.actors
    procs = [*ray.get([a.__ray_call__.remote(ray_port) for a in actors]), ray_port()]
    found = {pid: ours(pid, port) for pid, port in procs}
    found[os.getpid()] = [a for a in found[os.getpid()] if a not in f.driver_before]
    # the barrier store is a child process of the driver's, on the address the trainers
    # reach it by (and nothing else of the driver's listens there)
    store = f.ctl.state.store
    found[store.pid] = ours(store.pid, 0)
    assert found[store.pid] == [(f.ctl.state.store_host, store.port)]
    assert sum(map(len, found.values())) > 1  # the group stores and gloo are seen too
    engine_pids = [pid for pid, _ in procs[len(f.trainers.actors):-1]]
    assert all(found[pid] for pid in engine_pids)  # each engine rank's tcp target at least
    wild = {pid: [(a, p) for a, p in ls if ipaddress.ip_address(a).is_unspecified]
            for pid, ls in found.items()}
    assert not any(wild.values()), wild


def _update_line(audit: Path, version: int) -> dict:
    return [r for r in read_audit(audit) if r["kind"] == "update" and r["version"] == version][-1]


def test_a_planned_writer_cannot_write_while_the_engine_serves(fleet):
    f = fleet
    version = _train_and_update(f)
    assert engine_mismatches(f.cfg.model, f.trainers, f.replicas) == []
    assert _update_line(f.audit, version)["refused"] == {}
    owner, nic, addr = f.ctl.summary.regions_by_rank[0][0]  # a region rank 0 may write
    metas = [ray.get(a.wt_engine_meta.remote()) for rep in f.replicas for a in rep]
    region = next(t.region for m in metas for t in m.tensors if t.region.addr == addr
                  and (t.region.owner, t.region.nic) == (owner, nic))
    target = next(i for i, m in enumerate(metas) if any(t.region == region for t in m.tensors))

    def raw_write(actor, region):  # on trainer rank 0, a planned writer with its link key
        asyncio.run(actor._wt_link.nic.write(bytes(64), region, 0))

    with pytest.raises(ray.exceptions.RayTaskError, match="outside an update window"):
        ray.get(f.trainers[0].__ray_call__.remote(raw_write, region))
    assert engine_mismatches(f.cfg.model, f.trainers, f.replicas) == []  # nothing written
    assert _stats(f.replicas)[target]["refused_writes"] == 1
    version = next(f.versions)
    f.ctl.update(version)  # the next audit line names the engine rank that refused it
    line = _update_line(f.audit, version)
    rank = f"{metas[target].replica}/tp{metas[target].rank}"
    assert line["outcome"] == "ok"
    assert line["refused"] == {rank: {"connections": 0, "writes": 1}}


def test_a_new_replica_is_filled_from_a_peer_over_tcp(fleet):
    f = fleet
    (new,) = launch_engines(f.cfg, replicas=[2])
    assert f.ctl.add_replica(new) == "engine2"
    assert engine_mismatches(f.cfg.model, f.trainers, [new]) == []  # copied from a peer
    ray.get([t.train_step.remote(TOKENS) for t in f.trainers])
    assert f.ctl.update(next(f.versions)).bytes == f.summary.bytes_total * 3 // 2
    assert engine_mismatches(f.cfg.model, f.trainers, [*f.replicas, new]) == []


def test_an_outsider_cannot_pre_arrive_on_the_live_barrier_store(fleet):
    """An outsider who knows the barrier name (as if it had listed a torch TCPStore) tries
    to pre-arrive for rank 1 at the next version: our store refuses it at the handshake
    (it holds no key), stores nothing, and the update passes."""
    f = fleet
    version = next(f.versions)
    outsider = Outsider()
    try:
        state = f.ctl.state
        out = outsider.attempt(op="set", host=state.store_host, port=state.store.port,
                               key=f"{state.barrier_key.name}/v{version}/g0/1", value="0" * 64,
                               timeout_s=1)
    finally:
        outsider.close()
    assert "error" in out, out
    assert state.store.num_keys() == 0
    ray.get([t.train_step.remote(TOKENS) for t in f.trainers])
    f.ctl.update(version)
    lines = [r for r in read_audit(f.audit) if r["version"] == version]
    assert lines[-1]["kind"] == "update" and lines[-1]["outcome"] == "ok"
    assert not [r for r in lines if r["kind"] == "refused"]
    assert engine_mismatches(f.cfg.model, f.trainers, f.replicas) == []
