"""What a running fleet listens on (no listener of ours binds a wildcard address), and an
outsider on its live barrier store.

A fleet of the tiny model (trainers, engines, a controller that set up and ran
an update, over the ``tcp`` transport) runs on the shared cluster. For the driver and every actor
process, the listening TCP sockets are read from ``/proc/<pid>/net/tcp{,6}``
and ``/proc/<pid>/fd``. Ray's core-worker gRPC server (one per process) binds
``[::]``: that one is Ray's, found by its port (the owner address of an object
the process puts) and set apart; everything else in those processes is ours
(the barrier store, the group stores, gloo, the tcp targets) and must bind one
address.
Mooncake's handshake and data listeners bind every interface whatever we ask:
they are Mooncake's, documented in docs/security.md, and not part of this fleet.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

import pytest
import ray
from outsider.driver import Outsider  # tests/ is on sys.path (its conftest.py)

from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
from actors.audit import read_audit
from weight_transfer.errors import UpdateError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


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


@pytest.fixture(scope="module")
def fleet(ray_job, tmp_path_factory):
    """Trainers, engines and a controller that set up and ran update 1 (audit log on), over
    the ``tcp`` transport: its engine-side listeners are ours too (simnic has none)."""
    audit = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    CONFIGS / "clusters" / "local_cpu.yaml",
                                    audit_path=audit, barrier_timeout_s=30, transport="tcp")
    with launch_trainers(cfg) as trainers, launch_engines(cfg) as replicas:
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        ctl.setup()
        assert ctl.update(1).bytes > 0
        yield ctl, trainers, replicas, audit
        ctl.shutdown()


def test_no_listener_of_a_running_fleet_binds_a_wildcard(fleet):
    ctl, trainers, replicas, _ = fleet
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

    actors = trainers.actors + replicas.actors
    procs = [*ray.get([a.__ray_call__.remote(ray_port) for a in actors]), ray_port()]
    found = {pid: ours(pid, port) for pid, port in procs}
    # the barrier store is the driver's, on the address the trainers reach it by
    assert (ctl.state.store_host, ctl.state.store.port) in found[os.getpid()]
    assert sum(map(len, found.values())) > 1  # the group stores and gloo are seen too
    engine_pids = [pid for pid, _ in procs[len(trainers.actors):-1]]
    assert all(found[pid] for pid in engine_pids)  # each engine rank's tcp target at least
    wild = {pid: [(a, p) for a, p in ls if ipaddress.ip_address(a).is_unspecified]
            for pid, ls in found.items()}
    assert not any(wild.values()), wild


def test_an_outsider_pre_arrival_on_the_live_barrier_store_fails_the_update_named(fleet):
    """An outsider who learned the barrier name (say, by listing the store during a
    crossing) pre-arrives for rank 1 at the next version: the update fails naming rank 1
    and the tag, the audit line records it, nothing passes."""
    ctl, _, _, audit = fleet
    outsider = Outsider()
    try:
        host, port, name = ctl.state.store_host, ctl.state.store.port, ctl.state.barrier_key.name
        outsider(op="set", host=host, port=port, key=f"{name}/v2/g0/1", value="0" * 64)
    finally:
        outsider.close()
    with pytest.raises(UpdateError) as err:
        ctl.update(2)
    # Rank 1 finds a value it did not set, the others a value that is not rank 1's MAC:
    # whichever rank reports first, the error names rank 1 and the tag.
    named = re.compile(r"BarrierRefusedError: barrier wt-update-\w+/v2/g0: "
                       r"(pre-arrived|forged) arrival of rank 1 refused")
    assert named.search(str(err.value)), str(err.value)
    lines = [r for r in read_audit(audit) if r["version"] == 2]
    assert lines[-1]["kind"] == "update" and lines[-1]["outcome"] == "failed"
    assert named.search(lines[-1]["error"])
    refused = [r for r in lines if r["kind"] == "refused"]
    assert refused and all(r["rank"] == 1 and r["tag"] == "v2/g0" for r in refused)
    assert {r["reason"] for r in refused} <= {"pre-arrived", "forged"}
    assert all(r["what"] == "barrier arrival" for r in refused)
