"""The transport contract: a backend is one module registered by name.

A small in-process transport (memcpy into registered memory) is defined and
registered here, in this test module only: it is selectable by name, its options
are validated by its own model, and a plan's updates write through it with the
bytes landed equal to the expected ones. Also: the registry refuses duplicates
and names the registered transports for an unknown one; ``disconnect`` makes
later writes to that peer fail (simnic, rdma, mooncake); each backend classes
its own transient errors; the generic modules name no transport.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import ctypes
import errno
import secrets
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import Field
from test_rdma_transport import Fabric, fake_verbs, stand_in_plain_verbs
from test_staging import Replay

from weight_transfer.sender.retry import RetryingWriter, RetryPolicy
from weight_transfer.transport import (
    BACKENDS,
    make_transport,
    parse_transport,
    register_transport,
    registered_transports,
    transport_class,
)
from weight_transfer.transport.base import (
    LinkDownError,
    PeerUnreachableError,
    RemoteAccessError,
    RetriesExhaustedError,
    TransientTransportError,
    TransportBase,
    TransportError,
    TransportOptions,
    source_buffer,
    target_buffer,
)
from weight_transfer.transport.handshake import HostId, reaches
from weight_transfer.transport.mooncake.transport import (
    MooncakeLinkError,
    MooncakeTransport,
    _Chunk,
)
from weight_transfer.transport.rdma.errors import RdmaQueueFullError, completion_error, post_error
from weight_transfer.transport.registry import unregister_transport
from weight_transfer.transport.simnic.nic import SimNic
from weight_transfer.types import PeerInfo, RegionDesc

ROOT = Path(__file__).resolve().parents[2]
NAME = "memcpy-test"

# --------------------------------------------------------------------------- a transport

_NICS: dict[str, MemcpyNic] = {}  # endpoint token -> NIC (one process: the fabric)


class MemcpyOptions(TransportOptions):
    """Options of the test transport."""

    max_inflight: int = Field(default=2, ge=1)
    tag: str = "x"


class MemcpyNic(TransportBase):
    """In-process one-sided writes: memmove into memory registered on the target NIC."""

    kind = NAME
    Options = MemcpyOptions

    def __init__(self, *, owner: str, nic: str, max_inflight: int = 2, tag: str = "x",
                 node: str = "") -> None:
        super().__init__(owner=owner, nic=nic)
        self.max_inflight, self.tag, self.node = max_inflight, tag, node
        self.token = secrets.token_hex(8)
        self._regions: dict[int, tuple[RegionDesc, object]] = {}
        _NICS[self.token] = self

    def register(self, buf):
        mem = target_buffer(buf)
        rkey = len(self._regions) + 1
        desc = RegionDesc(owner=self.owner, nic=self.nic, addr=mem.addr, length=mem.nbytes,
                          rkey=rkey, transport=self.kind)
        self._regions[rkey] = (desc, mem.keepalive)
        return desc

    def deregister(self, desc):
        del self._regions[desc.rkey]

    def peer_info(self, remote_owner, remote_nic=None):
        return PeerInfo(owner=self.owner, nic=self.nic, transport=self.kind,
                        endpoint={"token": self.token})

    def check_peer(self, peer):
        super().check_peer(peer)
        if peer.endpoint.get("token") not in _NICS:
            raise ValueError(f"peer {peer.owner}/{peer.nic}: unknown token")

    def connect(self, peer):
        self.check_peer(peer)
        self._add_peer(peer.owner, peer.nic, _NICS[peer.endpoint["token"]])

    async def write(self, src, dst, dst_offset=0):
        mem = source_buffer(src)
        self._check_destination(dst, dst_offset, mem.nbytes)
        target = self._peer_for(dst)
        async with self._semaphore():
            if target._regions.get(dst.rkey, (None,))[0] != dst:
                raise RemoteAccessError(f"{dst.describe()} is not registered")
            ctypes.memmove(dst.addr + dst_offset, mem.addr, mem.nbytes)
            await asyncio.sleep(0)
        self.bytes_written += mem.nbytes
        self.writes += 1

    def close(self):
        _NICS.pop(self.token, None)
        self._take_peers()


@pytest.fixture
def memcpy():
    register_transport(NAME, __name__, "MemcpyNic")
    try:
        yield NAME
    finally:
        unregister_transport(NAME)


# --------------------------------------------------------------------------- registry


def test_builtins_are_registered_and_load_lazily():
    assert {"simnic", "rdma", "mooncake"} <= set(registered_transports()) == set(BACKENDS)
    for name in ("simnic", "rdma", "mooncake"):
        cls = transport_class(name)
        assert issubclass(cls, TransportBase) and cls.kind == name
        assert issubclass(cls.Options, TransportOptions)


def test_a_transport_from_a_test_module_is_selectable_with_its_options(memcpy):
    assert memcpy in registered_transports()
    spec = parse_transport(memcpy, {"max_inflight": 3, "tag": "t"}, where="TransferConfig")
    assert spec.options == MemcpyOptions(max_inflight=3, tag="t")
    with spec.open(owner="trainer0", nic="nic0", node="n") as nic:
        assert isinstance(nic, MemcpyNic) and (nic.max_inflight, nic.tag) == (3, "t")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['speed'\] for transport "
                                         r"'memcpy-test'.*known: \['max_inflight', 'tag'\]"):
        parse_transport(memcpy, {"speed": 1}, where="TransferConfig")
    with pytest.raises(ValueError, match=r"TransferConfig\.transport_options\.max_inflight"):
        parse_transport(memcpy, {"max_inflight": 0}, where="TransferConfig")
    with pytest.raises(ValueError, match="SimNicOptions given for transport 'memcpy-test'"):
        parse_transport(memcpy, transport_class("simnic").Options(), where="cfg")
    # Generic behaviour from the base class: it reaches other hosts, checks peers' kind.
    a, b = HostId(hostname="a", address="10.0.0.1"), HostId(hostname="b", address="10.0.0.2")
    assert reaches(spec, a, b)


def test_plan_updates_write_through_the_registered_transport(memcpy):
    spec = parse_transport(memcpy, {}, where="test")
    target, writer = spec.open(owner="engines", nic="t"), spec.open(owner="trainers", nic="w")
    try:
        writer.connect(target.peer_info("trainers"))
        r = Replay(target, writer)
        transfers = r.transfers()
        for version in (1, 2):
            reports = r.update(transfers, version)
            assert sum(rep.bytes_written for rep in reports) == r.plan.bytes_total
            r.check_bytes()  # every engine byte equals the reference layout of the weights
        assert writer.bytes_written == 2 * r.plan.bytes_total and writer.writes > 0
        for t in transfers:
            t.close()
    finally:
        writer.close()
        target.close()


def test_duplicate_registration_is_refused(memcpy):
    with pytest.raises(ValueError, match=r"transport 'memcpy-test' is already registered \(as "
                                         r".*:MemcpyNic\)"):
        register_transport(memcpy, "elsewhere", "Other")
    with pytest.raises(ValueError, match="'simnic' is already registered"):
        register_transport("simnic", __name__, "MemcpyNic")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        register_transport("", __name__, "MemcpyNic")


def test_unknown_names_list_the_registered_ones(memcpy):
    known = r"known: \['memcpy-test', 'mooncake', 'rdma', 'simnic', 'tcp'\]"
    with pytest.raises(ValueError, match=rf"unknown transport 'pigeon'; {known}"):
        make_transport("pigeon", owner="a", nic="b")
    with pytest.raises(ValueError, match=rf"cfg\.transport: unknown transport 'pigeon'.*{known}"):
        parse_transport("pigeon", {}, where="cfg")


def test_a_bad_registration_fails_on_first_use_naming_it():
    register_transport("ghost", "no.such.module", "Nic")
    register_transport("plain", __name__, "MemcpyOptions")  # not a TransportBase
    try:
        with pytest.raises(ValueError,
                           match=r"transport 'ghost': cannot load no\.such\.module:Nic"):
            transport_class("ghost")
        with pytest.raises(ValueError, match="is not a TransportBase subclass"):
            transport_class("plain")
    finally:
        unregister_transport("ghost")
        unregister_transport("plain")


# --------------------------------------------------------------------------- disconnect


def _write(nic, desc, data=b"abcdefgh"):
    asyncio.run(nic.write(np.frombuffer(bytearray(data), dtype=np.uint8), desc, 0))


def _check_disconnect(writer, target, owner, nic):
    buf = np.zeros(8, dtype=np.uint8)
    desc = target.register(buf)
    _write(writer, desc)
    assert bytes(buf) == b"abcdefgh"
    assert writer.disconnect(owner, nic) == 1
    with pytest.raises(PeerUnreachableError,
                       match=rf"disconnected from peer {owner}/{nic} \(it was removed\); "
                             r"connect\(\) again"):
        _write(writer, desc, b"zzzzzzzz")
    assert bytes(buf) == b"abcdefgh"  # nothing landed
    assert writer.disconnect(owner, nic) == 0  # nothing left to close
    assert not writer.is_transient(PeerUnreachableError("x"))  # a removed peer: not retried
    return buf, desc


def test_simnic_disconnect_closes_the_peer_and_refuses_later_writes():
    target, writer = SimNic(owner="engines", nic="t"), SimNic(owner="trainers", nic="w")
    try:
        writer.connect(target.peer_info("trainers"))
        buf, desc = _check_disconnect(writer, target, "engines", "t")
        writer.connect(target.peer_info("trainers"))  # connecting again heals it
        _write(writer, desc, b"12345678")
        assert bytes(buf) == b"12345678"
    finally:
        writer.close()
        target.close()


def test_rdma_disconnect_closes_the_qp_and_refuses_later_writes():
    fabric = Fabric(stand_in_plain_verbs())
    w = make_transport("rdma", owner="trainers", nic="w", verbs=fake_verbs(fabric))
    t = make_transport("rdma", owner="engines", nic="t", verbs=fake_verbs(fabric))
    try:
        w.connect(t.peer_info("trainers"))
        t.connect(w.peer_info("engines"))
        qps = len(fabric.qps)
        _check_disconnect(w, t, "engines", "t")
        assert not w._peers  # its QP is gone from the table (and closed)
        assert len(fabric.qps) == qps - 1  # the writer's QP to it was closed
    finally:
        w.close()
        t.close()


def _bare_mooncake(**attrs):
    """A MooncakeTransport without an engine, for its bookkeeping and classification."""
    m = MooncakeTransport.__new__(MooncakeTransport)
    TransportBase.__init__(m, owner="trainers", nic="mc0")
    m._me = m.label = "mooncake trainers/mc0"
    m._closed, m.connect_timeout_s = False, 0.05
    for key, value in attrs.items():
        setattr(m, key, value)
    return m


def test_mooncake_disconnect_forgets_the_session():
    m = _bare_mooncake()
    desc = RegionDesc(owner="engines", nic="mc0", addr=4096, length=64, rkey=7,
                      transport="mooncake")
    m._add_peer("engines", "mc0", "127.0.0.1:12345")
    assert m._session_for(desc) == "127.0.0.1:12345"
    assert m.disconnect("engines") == 1  # every NIC of that owner
    with pytest.raises(PeerUnreachableError, match="disconnected from peer engines/mc0"):
        m._session_for(desc)
    m._add_peer("engines", "mc0", "127.0.0.1:12345")  # connect again
    assert m._session_for(desc) == "127.0.0.1:12345"


# --------------------------------------------------------------------------- transient errors


def test_simnic_classes_a_link_down_as_transient_only():
    nic = SimNic(owner="w", nic="n")
    try:
        assert nic.is_transient(LinkDownError("link down"))
        for exc in (RemoteAccessError("rkey"), PeerUnreachableError("gone"),
                    TransportError("other"), RetriesExhaustedError("x"), ValueError("bad")):
            assert not nic.is_transient(exc)
    finally:
        nic.close()


def test_rdma_classes_a_full_send_queue_as_transient():
    region = RegionDesc(owner="t", nic="n", addr=4096, length=64, rkey=1, transport="rdma")

    class Refused(Exception):
        def __init__(self, msg, code):
            super().__init__(msg, code)
            self.error_code = code

    for code in (errno.ENOMEM, errno.EAGAIN, errno.EBUSY, errno.ENOBUFS):
        err = post_error(Refused("Failed to post send", code), owner="w", nbytes=8,
                         region=region)
        assert isinstance(err, RdmaQueueFullError) and isinstance(err, TransientTransportError)
        assert "send queue full" in str(err)
    err = post_error(Refused("Failed to post send", errno.EINVAL), owner="w", nbytes=8,
                     region=region)
    assert type(err) is TransportError
    for status in (10, 12, 13, 20, 5):  # failed completions leave the QP in the error state
        assert not isinstance(completion_error(status, peer="t", region=region, offset=0,
                                               nbytes=8), TransientTransportError)


def test_rdma_retries_a_write_whose_post_found_the_queue_full():
    fabric = Fabric(stand_in_plain_verbs())
    w = make_transport("rdma", owner="trainers", nic="w", verbs=fake_verbs(fabric))
    t = make_transport("rdma", owner="engines", nic="t", verbs=fake_verbs(fabric))
    try:
        w.connect(t.peer_info("trainers"))
        t.connect(w.peer_info("engines"))
        qp = w._peers[("engines", "t")].qp
        real, calls = qp.post_send, []

        def full_once(wr):
            calls.append(wr.wr_id)
            if len(calls) == 1:
                raise fabric.plain.pyverbs_error.PyverbsRDMAError("Failed to post send",
                                                                  errno.ENOMEM)
            return real(wr)

        qp.post_send = full_once
        buf = np.zeros(8, dtype=np.uint8)
        desc = t.register(buf)
        writer = RetryingWriter(w, RetryPolicy(attempts=3, backoff_s=0.0))
        asyncio.run(writer.write(np.frombuffer(b"queued!!", dtype=np.uint8).copy(), desc, 0))
        assert bytes(buf) == b"queued!!" and writer.retries == 1 and len(calls) == 2
    finally:
        w.close()
        t.close()


def _classify(probe_rc):
    """Mooncake's verdict on a failed chunk whose probe returned ``probe_rc`` (None: hangs)."""

    def call(fn, *args):
        fut = concurrent.futures.Future()
        if probe_rc is not None:
            fut.set_result(probe_rc)
        return fut

    m = _bare_mooncake(_calls=SimpleNamespace(call=call),
                       _engine=SimpleNamespace(send_probe=None))
    chunk = _Chunk("127.0.0.1:1", "engines/mc0", 4096, 8192, 64, "write of 64 B")
    exc = asyncio.run(m._classify_failure(chunk, -1, "where"))
    return exc, m.is_transient(exc)


def test_mooncake_classes_a_refused_or_reset_peer_as_transient():
    exc, transient = _classify(-1)  # the peer's handshake port refused the probe
    assert isinstance(exc, MooncakeLinkError) and isinstance(exc, PeerUnreachableError)
    assert transient and "does not answer a probe" in str(exc)
    exc, transient = _classify(0)  # alive: the target refused the bytes
    assert isinstance(exc, RemoteAccessError) and not transient
    exc, transient = _classify(None)  # no answer in time: a stalled peer, not retried
    assert type(exc) is PeerUnreachableError and not transient


# --------------------------------------------------------------------------- no names


def _code_strings(path: Path) -> set[str]:
    """String constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs}


@pytest.mark.parametrize("module", ["weight_transfer/transport/options.py",
                                    "weight_transfer/transport/handshake.py",
                                    "weight_transfer/sender/retry.py",
                                    "weight_transfer/sender/executor.py",
                                    "weight_transfer/sender/staging.py",
                                    "weight_transfer/sender/bucket_prepare.py",
                                    "weight_transfer/sender/delta/executor.py"])
def test_generic_modules_branch_on_no_transport_name(module):
    strings = _code_strings(ROOT / module)
    assert not strings & {"simnic", "rdma", "mooncake"}, module
    source = (ROOT / module).read_text()
    for capability in ("supports_device_memory", "register_source", "check_peer",
                       "bytes_written", "is_transient", "disconnect"):
        assert f'getattr(transport, "{capability}"' not in source
        assert f'getattr(nic, "{capability}"' not in source


def test_simnic_is_re_capped_through_its_own_method():
    nic = SimNic(owner="w", nic="n")
    try:
        nic.set_bandwidth(2.0)
        assert nic.bandwidth_gbps == 2.0 and nic._link._bytes_per_s == 2e9
        nic.set_bandwidth(None)
        assert nic.bandwidth_gbps is None and nic._link._bytes_per_s is None
        with pytest.raises(ValueError, match="bandwidth_gbps must be None or > 0"):
            nic.set_bandwidth(-1.0)
    finally:
        nic.close()
