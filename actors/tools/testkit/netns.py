"""Hosts that are really separate: network namespaces joined by veth pairs and a bridge.

:class:`NetnsNetwork` makes one network namespace per *site* (``trainers``,
``engines`` ...) and one more, the *switch*, that holds a bridge: each site gets
a veth pair, its end ``wt0`` inside the site with an address of its own
(``10.213.X.k/24``, a subnet no route of this host uses), the other end on the
bridge. Every site has its own loopback (up) and no default route: a site
reaches the other sites and nothing else, and the host's network does not see
them. Every name carries the creating process's pid (``wt<pid>a``,
``wt<pid>sw``), so runs never share a namespace; :meth:`NetnsNetwork.close`
kills every process still inside a namespace it made (``ip netns pids``) and
deletes the namespaces, which deletes their veths::

    with NetnsNetwork(["trainers", "engines"]) as net:
        net.shape("engines", Shaping(rate_mbit=40))      # tc tbf, both directions
        net.run("trainers", ["ping", "-c1", net.addr("engines")])
        proc = net.popen("engines", ["python", "-m", "..."], env=...)

Needs root and ``ip netns``: :func:`netns_unavailable` says why not (tests skip
with that reason). ``tc ... netem`` (delay) is missing from these kernels; the
token bucket (``tbf``) shapes the rate.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

SITE_DEV = "wt0"  # the veth end inside each site (names are per namespace)
SUBNET_BASE = ipaddress.ip_network("10.213.0.0/16")
KILL_WAIT_S = 10.0


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message names the command and its output."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({out.returncode}): "
                         f"{(out.stderr or out.stdout).strip()}")
    return out


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, ``ip netns add`` fails),
    or None. Makes and deletes one probe namespace."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` or `tc` (iproute2) is not installed"
    probe = f"wt{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except (NetnsError, OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns add` fails: {exc}"
    _ip("netns", "del", probe, check=False)
    return None


def host_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this host's routing table knows (``ip -j route``), default aside."""
    out = []
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "default")
        if dst in ("default", "broadcast") or ":" in dst:
            continue
        with contextlib.suppress(ValueError):
            out.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return out


def pick_subnet(seed: int | None = None) -> ipaddress.IPv4Network:
    """A /24 of 10.213.0.0/16 that no route of this host overlaps (tried from ``seed``,
    default the pid, so concurrent runs tend to differ too)."""
    used = host_networks()
    subnets = list(SUBNET_BASE.subnets(new_prefix=24))
    start = (os.getpid() if seed is None else seed) % len(subnets)
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError(f"every /24 of {SUBNET_BASE} overlaps a route of this host")


def link_counters(ns: str, dev: str = SITE_DEV) -> dict[str, int]:
    """Bytes the link ``dev`` of namespace ``ns`` carried so far: ``{"in": ..., "out": ...}``
    (interface counters: every protocol counts, Ray's control traffic too). Works from any
    namespace (root reads them through ``ip -n``)."""
    stats = json.loads(_ip("-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout)[0]
    stats = stats["stats64"]
    return {"in": int(stats["rx"]["bytes"]), "out": int(stats["tx"]["bytes"])}


@dataclass(frozen=True, slots=True, kw_only=True)
class Shaping:
    """A token-bucket rate limit (``tc qdisc ... tbf``) on one site's link, both ways."""

    rate_mbit: float
    burst_bytes: int = 32 * 1024
    latency_ms: float = 200.0

    def __post_init__(self) -> None:
        if self.rate_mbit <= 0 or self.burst_bytes <= 0 or self.latency_ms <= 0:
            raise ValueError(f"Shaping: rate, burst and latency must be positive: {self}")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def tbf_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(self.burst_bytes),
                "latency", f"{self.latency_ms:g}ms"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """One namespace on the bridge: its label, namespace name, address and switch port."""

    label: str
    ns: str
    addr: str
    port: str  # the veth end on the switch's bridge


class NetnsNetwork:
    """Site namespaces on one bridge (see the module docstring); a context manager."""

    def __init__(self, labels: Sequence[str], *, subnet: ipaddress.IPv4Network | None = None,
                 prefix: str | None = None) -> None:
        if not labels or len(set(labels)) != len(labels):
            raise ValueError(f"NetnsNetwork: site labels must be distinct and non-empty: "
                             f"{list(labels)}")
        if len(labels) > 26:
            raise ValueError(f"NetnsNetwork: at most 26 sites, got {len(labels)}")
        self.prefix = prefix or f"wt{os.getpid()}"
        self.subnet = subnet or pick_subnet()
        hosts = list(self.subnet.hosts())
        self.switch = f"{self.prefix}sw"
        self.sites = {label: Site(label=label, ns=f"{self.prefix}{chr(97 + i)}",
                                  addr=str(hosts[i]), port=f"p{chr(97 + i)}")
                      for i, label in enumerate(labels)}
        self._made: list[str] = []
        self.shaped: dict[str, Shaping] = {}

    def __enter__(self) -> NetnsNetwork:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this network made (sites and switch), in order of making."""
        return list(self._made)

    def site(self, label: str) -> Site:
        try:
            return self.sites[label]
        except KeyError:
            raise ValueError(f"no site {label!r}; sites: {sorted(self.sites)}") from None

    def addr(self, label: str) -> str:
        return self.site(label).addr

    def start(self) -> None:
        """Make the switch and every site (closed again when a step fails)."""
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for site in self.sites.values():
                self._add_site(site)
        except BaseException:
            self.close()
            raise
        log.info("namespaces %s on %s (switch %s)", [s.ns for s in self.sites.values()],
                 self.subnet, self.switch)

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_site(self, site: Site) -> None:
        self._add_ns(site.ns)
        _ip("link", "add", SITE_DEV, "netns", site.ns, "type", "veth",
            "peer", "name", site.port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", site.port, "master", "br0")
        _ip("-n", self.switch, "link", "set", site.port, "up")
        _ip("-n", site.ns, "addr", "add", f"{site.addr}/{self.subnet.prefixlen}",
            "dev", SITE_DEV)
        _ip("-n", site.ns, "link", "set", SITE_DEV, "up")

    # ------------------------------------------------------------------ shaping

    def shape(self, label: str, shaping: Shaping) -> None:
        """Limit ``label``'s link to ``shaping``'s rate in both directions (the site's egress
        on ``wt0`` and its ingress as the switch port's egress)."""
        site = self.site(label)
        for ns, dev in ((site.ns, SITE_DEV), (self.switch, site.port)):
            _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                *shaping.tbf_args())
        self.shaped[label] = shaping

    def unshape(self, label: str) -> None:
        site = self.site(label)
        for ns, dev in ((site.ns, SITE_DEV), (self.switch, site.port)):
            _ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        self.shaped.pop(label, None)

    def link_bytes(self, label: str) -> dict[str, int]:
        """Bytes the site's link carried so far (:func:`link_counters`)."""
        return link_counters(self.site(label).ns)

    # ------------------------------------------------------------------ processes

    def argv(self, label: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside site ``label``'s namespace."""
        return ["ip", "netns", "exec", self.site(label).ns, *argv]

    def run(self, label: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(self.argv(label, argv), capture_output=True, text=True,
                             env=None if env is None else dict(env), timeout=timeout)
        if check and out.returncode != 0:
            raise NetnsError(f"{list(argv)} in {label} failed ({out.returncode}): "
                             f"{(out.stderr or out.stdout).strip()[-2000:]}")
        return out

    def popen(self, label: str, argv: Sequence[str], **kw: object) -> subprocess.Popen:
        """A process in ``label``'s namespace, in a session of its own (killed as a group)."""
        return subprocess.Popen(self.argv(label, argv), start_new_session=True, **kw)

    def pids(self, ns: str) -> list[int]:
        out = _ip("netns", "pids", ns, check=False)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process inside a namespace of this network; wait until none is."""
        deadline = time.monotonic() + KILL_WAIT_S
        while True:
            pids = [p for ns in self._made for p in self.pids(ns)]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if time.monotonic() > deadline:
                log.error("processes %s still inside namespaces %s", pids, self._made)
                return
            time.sleep(0.1)

    def close(self) -> None:
        """Kill what runs inside, delete every namespace made (their veths go with them).
        Idempotent; logs what it could not delete."""
        self.kill_all()
        for ns in reversed(self._made):
            out = _ip("netns", "del", ns, check=False)
            if out.returncode != 0:
                log.error("namespace %s not deleted: %s", ns, out.stderr.strip())
        self._made.clear()
        self.shaped.clear()
