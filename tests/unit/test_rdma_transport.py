"""RdmaTransport end to end against an in-process model of a verbs device.

The model (``FakeVerbs``) keeps pyverbs' call signatures and RC semantics, and
really moves bytes: a QP must pass RESET -> INIT -> RTR -> RTS in order; an
RDMA WRITE reaches the QP named by ``dest_qp_num`` only if that QP is connected
back to the writer with matching PSNs; the target MR must exist in the target's
PD (rkey), cover the range and allow remote write; the source must lie in an
MR of the writer's PD (lkey). A failed WRITE completes with the verbs status
and moves both QPs to ERR; later WRs are flushed. The send queue and the CQ
assert they never overflow.

The plain pyverbs classes that need no device (``QPAttr``, ``AHAttr``, ``GID``,
``QPCap``, the errors) come from ``plain``: stand-ins defined here, so that the
model runs without pyverbs, and the real pyverbs classes where pyverbs imports
(the ``pyverbs`` variant of every test), which checks that the transport calls
them with pyverbs' signatures. The enum values are libibverbs' (checked below).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from weight_transfer.transport import PeerUnreachableError, RemoteAccessError, make_transport
from weight_transfer.transport.rdma.verbs import RdmaUnavailableError

MiB = 1 << 20
OK, LOC_PROT, FLUSH, REM_ACCESS, RETRY_EXC = 0, 4, 5, 10, 12

# libibverbs enum values (the same in every rdma-core; compared with pyverbs below)
e = SimpleNamespace(
    IBV_QPS_RESET=0, IBV_QPS_INIT=1, IBV_QPS_RTR=2, IBV_QPS_RTS=3, IBV_QPS_ERR=6,
    IBV_QP_STATE=1, IBV_QPT_RC=2, IBV_WR_RDMA_WRITE=0, IBV_SEND_SIGNALED=2,
    IBV_PORT_ACTIVE=4, IBV_MTU_4096=5, IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2,
)


class Attrs(SimpleNamespace):
    """Stand-in for pyverbs' keyword-built attribute classes (QPAttr, QPCap, AHAttr...)."""


class PyverbsError(Exception):
    pass


class PyverbsRDMAError(PyverbsError):
    def __init__(self, msg, error_code=-1):
        super().__init__(msg)
        self.error_code = error_code


class GID(str):
    pass


PORT_STATES = {1: "Down", 2: "Init", 3: "Armed", 4: "Active", 5: "Defer"}


def stand_in_plain_verbs() -> SimpleNamespace:
    return SimpleNamespace(
        addr=SimpleNamespace(GID=GID, GlobalRoute=Attrs, AHAttr=Attrs),
        enums=e,
        pyverbs_error=SimpleNamespace(PyverbsError=PyverbsError,
                                      PyverbsRDMAError=PyverbsRDMAError),
        port_state_to_str=lambda state: f"{PORT_STATES.get(state, 'Unknown')} ({state})",
        QPCap=Attrs,
        QPAttr=Attrs,
    )


def pyverbs_plain_verbs() -> SimpleNamespace:
    import pyverbs.addr
    import pyverbs.device
    import pyverbs.enums
    import pyverbs.pyverbs_error
    import pyverbs.qp

    return SimpleNamespace(addr=pyverbs.addr, enums=pyverbs.enums,
                           pyverbs_error=pyverbs.pyverbs_error,
                           port_state_to_str=pyverbs.device.port_state_to_str,
                           QPCap=pyverbs.qp.QPCap, QPAttr=pyverbs.qp.QPAttr)


@pytest.fixture(params=[pytest.param("stand-ins"),
                        pytest.param("pyverbs", marks=pytest.mark.pyverbs)])
def plain(request) -> SimpleNamespace:
    """The device-free verbs classes the model uses: stand-ins, or pyverbs' own."""
    return stand_in_plain_verbs() if request.param == "stand-ins" else pyverbs_plain_verbs()


@pytest.mark.pyverbs
def test_the_stand_ins_match_pyverbs():
    pv = pyverbs_plain_verbs()
    for name, value in vars(e).items():
        assert getattr(pv.enums, name) == value, name
    for state in PORT_STATES:
        assert stand_in_plain_verbs().port_state_to_str(state) == pv.port_state_to_str(state)
    gid = "fe80:0000:0000:0000:0000:0000:0000:0007"
    assert str(pv.addr.GID(gid)) == str(GID(gid))


class Fabric:
    """What every fake device shares: QPs by number, MRs by key."""

    def __init__(self, plain, devices=("fake0",), max_msg_sz=MiB):
        self.plain = plain
        self.devices, self.max_msg_sz = list(devices), max_msg_sz
        self.qps: dict[int, FakeQP] = {}
        self.mrs: dict[int, FakeMR] = {}
        self.keys = itertools.count(0x1000, 0x100)
        self.qpns = itertools.count(0x40)
        self.mrs_created = 0


class FakeContext:
    def __init__(self, fabric, name):
        self.fabric, self.name = fabric, name

    def query_device(self):
        return SimpleNamespace(phys_port_cnt=1, max_qp_wr=64)

    def query_port(self, port):
        return SimpleNamespace(state=e.IBV_PORT_ACTIVE, gid_tbl_len=4, active_mtu=e.IBV_MTU_4096,
                               lid=7, link_layer=1, max_msg_sz=self.fabric.max_msg_sz)

    def query_gid(self, port, index):
        return self.fabric.plain.addr.GID("fe80:0000:0000:0000:0000:0000:0000:0007")

    def close(self):
        pass


class FakePD:
    def __init__(self, ctx):
        self.fabric = ctx.fabric

    def close(self):
        pass


class FakeMR:
    def __init__(self, pd, length, access, address=None):
        assert address, "the transport registers its own memory"
        self.pd, self.addr, self.length, self.access = pd, address, length, access
        self.lkey = self.rkey = next(pd.fabric.keys)
        pd.fabric.mrs[self.rkey] = self
        pd.fabric.mrs_created += 1

    def covers(self, pd, addr, n):
        return pd is self.pd and self.addr <= addr and addr + n <= self.addr + self.length

    def close(self):
        self.pd.fabric.mrs.pop(self.rkey, None)


class FakeCQ:
    def __init__(self, ctx, cqe, cq_context, channel, comp_vector):
        self.cqe, self.entries = cqe, []

    def push(self, wr_id, status):
        assert len(self.entries) < self.cqe, "CQ overflow"
        self.entries.append(SimpleNamespace(wr_id=wr_id, status=status, vendor_err=0))

    def poll(self, n):
        done, self.entries = self.entries[:min(n, 2)], self.entries[min(n, 2):]
        for wc in done:
            wc.qp.unpolled -= 1
        return len(done), done

    def close(self):
        pass


class FakeQP:
    def __init__(self, pd, init):
        self.pd, self.cq, self.cap = pd, init.scq, init.cap.max_send_wr
        self.qp_num, self.state, self.unpolled = next(pd.fabric.qpns), e.IBV_QPS_RESET, 0
        pd.fabric.qps[self.qp_num] = self
        self.resets = 0

    def query(self, mask):
        return self.pd.fabric.plain.QPAttr(qp_state=self.state), None

    def modify(self, attr, mask):
        assert mask == e.IBV_QP_STATE and attr.qp_state == e.IBV_QPS_RESET
        self.state, self.resets = e.IBV_QPS_RESET, self.resets + 1

    def _step(self, frm, to):
        if self.state != frm:
            raise self.pd.fabric.plain.pyverbs_error.PyverbsRDMAError(
                f"bad transition {self.state} -> {to}", 22)
        self.state = to

    def to_init(self, attr):
        self._step(e.IBV_QPS_RESET, e.IBV_QPS_INIT)
        self.access = attr.qp_access_flags

    def to_rtr(self, attr):
        self._step(e.IBV_QPS_INIT, e.IBV_QPS_RTR)
        self.dest, self.rq_psn, self.dlid = attr.dest_qp_num, attr.rq_psn, attr.ah_attr.dlid

    def to_rts(self, attr):
        self._step(e.IBV_QPS_RTR, e.IBV_QPS_RTS)
        self.sq_psn = attr.sq_psn

    def post_send(self, wr):
        assert wr.send_flags & e.IBV_SEND_SIGNALED and wr.opcode == e.IBV_WR_RDMA_WRITE
        assert self.unpolled < self.cap, "send queue overflow"
        if self.state not in (e.IBV_QPS_RTS, e.IBV_QPS_ERR):
            raise self.pd.fabric.plain.pyverbs_error.PyverbsRDMAError("Failed to post send", 22)
        self.unpolled += 1
        status = FLUSH if self.state == e.IBV_QPS_ERR else self._execute(wr)
        if status != OK:
            self.state = e.IBV_QPS_ERR
        self.cq.push(wr.wr_id, status)
        self.cq.entries[-1].qp = self

    def _execute(self, wr):
        fabric, sge = self.pd.fabric, wr.sg
        src = fabric.mrs.get(sge.lkey)
        if src is None or not src.covers(self.pd, sge.addr, sge.length):
            return LOC_PROT
        peer = fabric.qps.get(self.dest)
        if peer is None or peer.state not in (e.IBV_QPS_RTR, e.IBV_QPS_RTS) or \
                peer.dest != self.qp_num or peer.rq_psn != self.sq_psn:
            return RETRY_EXC
        dst = fabric.mrs.get(wr.rkey)
        if dst is None or not dst.covers(peer.pd, wr.remote, sge.length) or \
                not dst.access & e.IBV_ACCESS_REMOTE_WRITE or \
                not peer.access & e.IBV_ACCESS_REMOTE_WRITE:
            peer.state = e.IBV_QPS_ERR
            return REM_ACCESS
        ctypes.memmove(wr.remote, sge.addr, sge.length)
        return OK

    def close(self):
        self.pd.fabric.qps.pop(self.qp_num, None)


class FakeSendWR:
    def __init__(self, wr_id, opcode, num_sge, sg, send_flags):
        assert num_sge == len(sg) == 1
        self.wr_id, self.opcode, self.sg, self.send_flags = wr_id, opcode, sg[0], send_flags

    def set_wr_rdma(self, rkey, addr):
        self.rkey, self.remote = rkey, addr


def fake_verbs(fabric: Fabric) -> SimpleNamespace:
    def init_attr(qp_type, scq, rcq, cap, sq_sig_all):
        assert qp_type == e.IBV_QPT_RC and scq is rcq and sq_sig_all == 0
        return SimpleNamespace(scq=scq, cap=cap)

    plain = fabric.plain
    return SimpleNamespace(
        addr=plain.addr, enums=plain.enums, pyverbs_error=plain.pyverbs_error,
        device=SimpleNamespace(
            get_device_list=lambda: [SimpleNamespace(name=n.encode()) for n in fabric.devices],
            Context=lambda name: FakeContext(fabric, name),
            port_state_to_str=plain.port_state_to_str),
        pd=SimpleNamespace(PD=FakePD),
        cq=SimpleNamespace(CQ=FakeCQ),
        mr=SimpleNamespace(MR=FakeMR),
        qp=SimpleNamespace(QP=FakeQP, QPCap=plain.QPCap, QPAttr=plain.QPAttr,
                           QPInitAttr=init_attr),
        wr=SimpleNamespace(SGE=lambda a, n, k: SimpleNamespace(addr=a, length=n, lkey=k),
                           SendWR=FakeSendWR),
    )


@pytest.fixture
def fabric(plain):
    return Fabric(plain)


def nic(fabric, owner, **kw):
    return make_transport("rdma", owner=owner, nic=f"{owner}-nic", verbs=fake_verbs(fabric), **kw)


def pair(fabric, **kw):
    w, t = nic(fabric, "writer", **kw), nic(fabric, "target")
    w.connect(t.peer_info("writer"))
    t.connect(w.peer_info("target"))
    return w, t


def rand(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_bytes_land_in_chunks_through_a_bounded_window(fabric):
    w, t = pair(fabric, max_inflight=3, chunk_bytes=256 * 1024)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    desc = t.register(dst)
    assert (desc.owner, desc.nic, desc.transport, desc.length) == ("target", "target-nic",
                                                                   "rdma", 4 * MiB)
    src = rand(3 * MiB + 5)
    asyncio.run(w.write(src, desc, 1000))
    assert np.array_equal(dst[1000:1000 + src.nbytes], src)
    assert not dst[:1000].any() and not dst[1000 + src.nbytes:].any()
    assert w.peak_inflight == 3
    assert set(fabric.mrs) == {desc.rkey}  # the per-write source MR is gone again


def test_chunks_never_exceed_the_port_max_message_size(plain):
    fabric = Fabric(plain, max_msg_sz=64 * 1024)
    w, t = pair(fabric, chunk_bytes=16 * MiB)
    assert w.chunk_bytes == 64 * 1024
    dst = np.zeros(MiB, dtype=np.uint8)
    src = rand(MiB, seed=1)
    asyncio.run(w.write(src, t.register(dst), 0))
    assert np.array_equal(dst, src)


def test_registered_sources_post_with_their_own_mr(fabric):
    w, t = pair(fabric)
    staged = rand(MiB, seed=2)
    w.register(staged)
    created = fabric.mrs_created
    dst = np.zeros(MiB, dtype=np.uint8)
    desc = t.register(dst)
    asyncio.run(w.write(staged[4096:], desc, 0))  # a slice inside the staged MR
    assert fabric.mrs_created == created + 1  # only the target's MR, no per-write MR
    assert np.array_equal(dst[:MiB - 4096], staged[4096:])


def test_wrong_rkey_then_recovery_by_connecting_again(fabric):
    w, t = pair(fabric)
    dst = np.zeros(MiB, dtype=np.uint8)
    desc = t.register(dst)
    wrong = dataclasses.replace(desc, rkey=desc.rkey ^ 0xFF)
    with pytest.raises(RemoteAccessError) as err:
        asyncio.run(w.write(rand(4096), wrong, 0))
    assert "peer 'target'" in str(err.value) and wrong.describe() in str(err.value)
    assert not dst.any()
    with pytest.raises(PeerUnreachableError, match=r"failed earlier.*remote access error"):
        asyncio.run(w.write(rand(16), desc, 0))
    w.connect(t.peer_info("writer"))  # the same PeerInfos: RESET -> RTS again
    t.connect(w.peer_info("target"))
    src = rand(MiB, seed=3)
    asyncio.run(w.write(src, desc, 0))
    assert np.array_equal(dst, src)


def test_deregistered_region_and_closed_peer_fail_with_the_right_class(fabric, plain):
    w, t = pair(fabric)
    dst = np.zeros(MiB, dtype=np.uint8)
    desc = t.register(dst)
    t.deregister(desc)
    with pytest.raises(RemoteAccessError, match="remote access error"):
        asyncio.run(w.write(rand(100), desc, 0))
    w2, t2 = pair(Fabric(plain))
    desc2 = t2.register(np.zeros(100, dtype=np.uint8))
    t2.close()
    with pytest.raises(PeerUnreachableError, match="retry exceeded error"):
        asyncio.run(w2.write(rand(100), desc2, 0))


def test_connect_is_idempotent_and_validates_the_peer(fabric):
    w, t = pair(fabric)
    qp = fabric.qps[w.peer_info("target").endpoint["qpn"]]
    w.connect(t.peer_info("writer"))
    assert qp.resets == 0 and qp.state == e.IBV_QPS_RTS
    with pytest.raises(ValueError, match="made for 'someone', not for 'writer'"):
        w.connect(t.peer_info("someone"))
    lone = nic(fabric, "lone")
    with pytest.raises(PeerUnreachableError, match="not connected to peer target/"):
        asyncio.run(lone.write(rand(8), t.register(np.zeros(8, dtype=np.uint8)), 0))
    lone.peer_info("target")  # a QP alone is not a connection
    with pytest.raises(PeerUnreachableError, match="not connected to peer target/"):
        asyncio.run(lone.write(rand(8), t.register(np.zeros(8, dtype=np.uint8)), 0))


def test_connect_may_come_before_peer_info(fabric):
    w, t = nic(fabric, "writer"), nic(fabric, "target")
    w.connect(t.peer_info("writer"))  # creates the writer's QP for 'target'
    t.connect(w.peer_info("target"))  # ... whose number peer_info now publishes
    dst = np.zeros(1000, dtype=np.uint8)
    src = rand(1000, seed=9)
    asyncio.run(w.write(src, t.register(dst), 0))
    assert np.array_equal(dst, src)


def test_local_checks_before_anything_is_posted(fabric):
    w, t = pair(fabric)
    desc = t.register(np.zeros(100, dtype=np.uint8))
    with pytest.raises(RemoteAccessError, match="outside region"):
        asyncio.run(w.write(rand(101), desc, 0))
    with pytest.raises(ValueError, match="transport 'simnic', not 'rdma'"):
        asyncio.run(w.write(rand(1), dataclasses.replace(desc, transport="simnic"), 0))
    with pytest.raises(ValueError, match="is not registered on target"):
        t.deregister(dataclasses.replace(desc, rkey=1))
    with pytest.raises(ValueError, match=r"owner=elsewhere.*is not registered on target"):
        t.deregister(dataclasses.replace(desc, owner="elsewhere"))
    with pytest.raises(ValueError, match="read-only"):
        t.register(np.frombuffer(b"abc", dtype=np.uint8))
    asyncio.run(w.write(b"", desc, 100))  # empty writes are a no-op


def test_construction_errors(fabric, plain):
    with pytest.raises(ValueError, match=r"max_inflight 65 must be in \[1, 64\]"):
        nic(fabric, "x", max_inflight=65)
    with pytest.raises(RdmaUnavailableError, match=r"'mlx5_1' not found; available: .'fake0'"):
        nic(fabric, "x", device="mlx5_1")
    with pytest.raises(RdmaUnavailableError, match=r"no RDMA device found.*simnic"):
        nic(Fabric(plain, devices=()), "x")


def test_close_releases_every_qp_and_mr(fabric):
    w, t = pair(fabric)
    t.register(np.zeros(10, dtype=np.uint8))
    w.register(np.zeros(10, dtype=np.uint8))
    w.close()
    t.close()
    t.close()
    assert fabric.qps == {} and fabric.mrs == {}


def test_selftest_loopback_on_the_model_device(monkeypatch, plain):
    from actors.tools.cli import selftest
    from weight_transfer.transport.rdma import transport as rdma

    fabric = Fabric(plain, max_msg_sz=MiB)
    monkeypatch.setattr(rdma, "import_pyverbs", lambda: fake_verbs(fabric))
    console = Console(width=200, record=True)
    assert selftest.run(None, "3M", 0, repeats=2, console=console) == 0
    out = console.export_text()
    assert "fake0 port 1" in out and "3 MiB" in out and "best GB/s" in out
    assert "3 writes, all equal" in out and "wrong rkey refused" in out and "yes" in out
    assert fabric.qps == {} and fabric.mrs == {}
