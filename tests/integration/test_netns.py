"""Hosts that are really separate: Ray nodes in network namespaces this module makes.

Three namespaces on one bridge (:mod:`actors.tools.testkit.netns`), each with its own
loopback, an address of its own in a 10.213.X.0/24 no route of this host uses,
and no route anywhere else: ``trainers`` (the Ray head, the driver, the trainer
ranks), ``site0`` and ``site1`` (the engine replicas, Ray worker nodes). One
set-up serves the module (Ray nodes start slowly); its teardown checks that no
namespace and no process of it is left. Drivers run in the head's namespace
(``ip netns exec``), so every byte between trainers and engines crosses a veth:

1. ``wt demo --transport tcp`` (our authenticated transport) across the sites,
   the update verified, the weights counted on site0's link;
2. ``wt demo --transport mooncake`` is refused at setup (Mooncake TCP authenticates
   nothing), naming the option and the hosts; with ``allow_unauthenticated: true``
   (set here on purpose) it runs across the sites, verified (the demos of 1 and 2 run
   one update on the demo's smallest shape, ``configs/clusters/local_cpu_small.yaml``:
   2 trainer ranks here, 1 replica x TP1 on site0; what crosses the hosts is their
   subject, not the shape, which ``test_demo.py`` runs);
3. replica groups behind links shaped with ``tc tbf``: the controllers' barrier
   store on the head's site address, every replica's bytes verified, a site's
   link carrying one copy per group instead of one per replica, the update
   taking at least the time the rate allows for the bytes it carried;
4. the harness removes its namespaces and kills what runs inside, also when the
   block that used them raised.

Needs root (skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from actors.tools.bench.groups.bench import SITES, run_groups_driver, sites_cluster
from actors.tools.demo.run_config import ROOT
from actors.tools.testkit.netns import NetnsNetwork, Shaping, netns_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
RATE = Shaping(rate_mbit=40)  # 5 MB/s: a 4 MB replica takes ~0.8 s over a site's link
SMALL = str(ROOT / "configs" / "clusters" / "local_cpu_small.yaml")


@pytest.fixture(scope="module")
def sites():
    if (why := netns_unavailable()) is not None:
        pytest.skip(why)
    with sites_cluster() as (net, cluster):
        made, tmp = net.namespaces, str(cluster.temp_dir)
        yield net, cluster
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in made if ns in listed.split()], listed
    left = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert tmp not in left, [ln for ln in left.splitlines() if tmp in ln]


def _demo(cluster, *args: str) -> dict:
    out = cluster.run_driver([sys.executable, "-m", "actors.tools.cli.main", "demo",
                              "--updates", "1", "--cluster", SMALL, "--json", "-", *args],
                             timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_the_sites_reach_each_other_and_nothing_else(sites):
    net, cluster = sites
    probe = ("import socket,sys; s=socket.socket(); s.settimeout(3); "
             "print(s.connect_ex((sys.argv[1], 9)))")
    for target, reachable in ((net.addr("site0"), True), ("192.0.2.1", False),
                              ("8.8.8.8", False)):
        out = net.run("trainers", [sys.executable, "-c", probe, target])
        code = int(out.stdout.strip())  # 111: refused (the host answered); else unreachable
        assert (code == 111) == reachable, (target, code)
    routes = net.run("site0", ["ip", "route"]).stdout
    assert "default" not in routes and str(net.subnet) in routes
    assert {n for n in cluster.nodes} == {net.addr(s) for s in SITES}


def test_demo_over_tcp_across_namespaces_is_verified(sites):
    net, cluster = sites
    before = net.link_bytes("site0")["in"]
    doc = _demo(cluster, "--transport", "tcp")
    assert len(doc["updates"]) == 1 and doc["verified"]
    assert all(u["verified"] for u in doc["updates"])
    # The engines are on site0: every update's bytes came in over its link.
    assert net.link_bytes("site0")["in"] - before >= sum(u["bytes"] for u in doc["updates"])


def test_demo_over_mooncake_tcp_is_refused_across_namespaces_by_default(sites):
    net, cluster = sites
    out = cluster.run_driver([sys.executable, "-m", "actors.tools.cli.main", "demo",
                              "--updates", "1", "--cluster", SMALL, "--transport", "mooncake"],
                             timeout=900)
    assert out.returncode != 0
    text = " ".join((out.stdout + out.stderr).split())  # rich wraps lines
    assert "allow_unauthenticated: true" in text and net.addr("trainers") in text, text[-3000:]


def test_demo_over_mooncake_tcp_across_namespaces_when_allowed(sites, tmp_path):
    net, cluster = sites
    run = yaml.safe_load((ROOT / "configs" / "runs" / "demo_mooncake.yaml").read_text())
    run["transfer"]["transport_options"]["allow_unauthenticated"] = True  # crosses hosts
    path = tmp_path / "demo_mooncake_netns.yaml"
    path.write_text(yaml.safe_dump(run))
    os.chmod(tmp_path, 0o755)
    before = net.link_bytes("site0")["in"]
    doc = _demo(cluster, "--config", str(path))
    assert doc["run"] == "demo-mooncake" and doc["verified"]
    assert all(u["verified"] for u in doc["updates"])
    assert net.link_bytes("site0")["in"] - before >= sum(u["bytes"] for u in doc["updates"])


def test_replica_groups_send_one_copy_per_site_over_a_shaped_link(sites):
    net, cluster = sites
    for site in SITES[1:]:
        net.shape(site, RATE)
    try:
        result = run_groups_driver(net, cluster, updates=1)
    finally:
        for site in SITES[1:]:
            net.unshape(site)
    direct, grouped = result["modes"]
    replica = result["replica_bytes"]
    # The controllers' barrier store listens on the head's site address, not loopback.
    assert {direct["store_host"], grouped["store_host"]} == {net.addr("trainers")}
    assert grouped["groups"] == [["engine0", "engine1"], ["engine2", "engine3"]]
    for mode, copies in ((direct, 2), (grouped, 1)):
        (u,) = mode["updates"]
        assert u["verified"], u["problems"]
        assert u["trainer_bytes"] == 2 * copies * replica
        assert u["peer_bytes"] == (2 - copies) * 2 * replica
        for site in SITES[1:]:
            link = u["link_in"][site]
            assert copies * replica <= link < (copies + 0.25) * replica, (mode["mode"], site)
        bound = max(u["link_in"].values()) / RATE.bytes_per_s
        assert u["seconds"] >= 0.9 * bound, (mode["mode"], u["seconds"], bound)
        assert u["seconds"] <= 5 * bound + 20, (mode["mode"], u["seconds"], bound)


def test_the_harness_removes_its_namespaces_and_processes_also_on_error():
    if (why := netns_unavailable()) is not None:
        pytest.skip(why)
    net = NetnsNetwork(["a", "b"], prefix=f"wt{os.getpid()}t")
    with pytest.raises(RuntimeError, match="boom"), net:
        proc = net.popen("b", ["sleep", "600"])
        net.shape("b", RATE)
        raise RuntimeError("boom")
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is not None  # killed inside its namespace
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns.startswith(net.prefix) for ns in listed.split()), listed
    assert net.namespaces == []
