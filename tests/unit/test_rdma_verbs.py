"""pyverbs glue: the import path, the no-device path, QP attributes as pyverbs objects."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from weight_transfer.transport import make_transport
from weight_transfer.transport.rdma.plan import Chunk
from weight_transfer.transport.rdma.verbs import (
    PYVERBS_MODULES,
    RdmaUnavailableError,
    import_pyverbs,
    list_devices,
    pick_device,
    poll_cq,
    post_write,
    rdma_unavailable_reason,
    to_qp_attr,
)
from weight_transfer.transport.rdma.wire import RdmaEndpoint, build_qp_attrs

NO_DEVICE = rdma_unavailable_reason()
needs_no_device = pytest.mark.skipif(NO_DEVICE is None, reason="an RDMA device is present")


@pytest.fixture
def pv():
    """The pyverbs modules; use it in tests marked ``pyverbs`` (skipped without pyverbs)."""
    return import_pyverbs()


@pytest.mark.pyverbs
def test_pyverbs_imports_from_the_venv(pv):
    for name in PYVERBS_MODULES:
        assert getattr(pv, name).__name__ == f"pyverbs.{name}"
    assert hasattr(pv.qp, "QP") and hasattr(pv.mr, "DmaBufMR")


def test_missing_pyverbs_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs.qp", None)  # `import pyverbs.qp` -> ImportError
    with pytest.raises(RdmaUnavailableError) as err:
        import_pyverbs()
    msg = str(err.value)
    assert "pyverbs" in msg and "python3-pyverbs" in msg and "setup_pyverbs.py" in msg
    with pytest.raises(RuntimeError, match="python3-pyverbs"):
        make_transport("rdma", owner="trainer/0", nic="nic0")
    assert "python3-pyverbs" in rdma_unavailable_reason()


@pytest.mark.pyverbs
@needs_no_device
@pytest.mark.parametrize("device", [None, "mlx5_0"])
def test_without_a_device_construction_fails_clearly(device):
    with pytest.raises(RuntimeError) as err:
        make_transport("rdma", owner="trainer/0", nic="nic0", device=device)
    msg = str(err.value)
    assert msg.startswith("no RDMA device found")
    assert (f"device {device!r}" if device else "the first device") in msg
    assert "simnic" in msg
    assert NO_DEVICE is not None and NO_DEVICE.startswith("no RDMA device found")


def test_list_devices_treats_the_empty_list_error_as_no_devices():
    class Err(Exception):
        pass

    def raising():
        raise Err("Failed to get devices list")

    fake = SimpleNamespace(device=SimpleNamespace(get_device_list=raising),
                           pyverbs_error=SimpleNamespace(PyverbsError=Err))
    assert list_devices(fake) == []
    named = SimpleNamespace(device=SimpleNamespace(get_device_list=lambda: [
        SimpleNamespace(name=b"mlx5_0"), SimpleNamespace(name=b"mlx5_1")]),
        pyverbs_error=fake.pyverbs_error)
    assert list_devices(named) == ["mlx5_0", "mlx5_1"]


def test_pick_device():
    assert pick_device(["mlx5_0", "mlx5_1"], None) == "mlx5_0"
    assert pick_device(["mlx5_0", "mlx5_1"], "mlx5_1") == "mlx5_1"
    with pytest.raises(RdmaUnavailableError, match=r"'mlx5_9' not found; available: \['mlx5_0'"):
        pick_device(["mlx5_0"], "mlx5_9")
    with pytest.raises(RdmaUnavailableError, match=r"asked for device 'rxe0'.*simnic"):
        pick_device([], "rxe0")


@pytest.mark.pyverbs
def test_qp_attrs_become_a_pyverbs_qpattr_field_by_field(pv):
    local = RdmaEndpoint(lid=3, gid="fe80::1", qpn=11, psn=100, port=2, mtu=4096, peer="e0")
    remote = RdmaEndpoint(lid=4, gid="fe80:0000:0000:0000:0000:0000:0000:0002", qpn=22,
                          psn=200, port=1, mtu=2048, peer="t0")
    a = build_qp_attrs(local, remote, gid_index=3, roce=False)
    attr = to_qp_attr(pv, a)
    for name in ("dest_qp_num", "rq_psn", "sq_psn", "max_dest_rd_atomic", "max_rd_atomic",
                 "min_rnr_timer", "timeout", "retry_cnt", "rnr_retry", "pkey_index",
                 "port_num", "path_mtu"):
        assert getattr(attr, name) == getattr(a, name), name
    assert attr.qp_access_flags == pv.enums.IBV_ACCESS_LOCAL_WRITE | \
        pv.enums.IBV_ACCESS_REMOTE_WRITE
    assert attr.path_mtu == pv.enums.IBV_MTU_2048
    ah = attr.ah_attr
    assert (ah.dlid, ah.port_num, ah.is_global, ah.sgid_index) == (4, 2, 1, 3)
    assert str(ah.dgid) == remote.gid and ah.hop_limit == 255


@pytest.mark.pyverbs
def test_qp_attr_without_grh(pv):
    ep = RdmaEndpoint(lid=3, gid="::", qpn=11, psn=1, port=1, mtu=1024, peer="x")
    attr = to_qp_attr(pv, build_qp_attrs(ep, ep, gid_index=0, roce=False))
    assert attr.ah_attr.is_global == 0 and attr.ah_attr.dlid == 3


@pytest.mark.pyverbs
def test_post_write_builds_one_signaled_rdma_write(pv):
    posted = []
    qp = SimpleNamespace(post_send=posted.append)
    post_write(pv, qp, 42, 0x1000, 0x55, Chunk(src=0x9000, dst=0x7000, length=4096), 0x66)
    (wr,) = posted
    assert wr.wr_id == 42 and wr.num_sge == 1
    assert wr.opcode == pv.enums.IBV_WR_RDMA_WRITE
    assert wr.send_flags == pv.enums.IBV_SEND_SIGNALED


def test_poll_cq_keeps_only_the_polled_entries():
    wcs = [SimpleNamespace(wr_id=i, status=0 if i else 10, vendor_err=i) for i in range(4)]
    cq = SimpleNamespace(poll=lambda n: (2, wcs))
    got = poll_cq(cq, 8)
    assert [(c.wr_id, c.status, c.vendor_err) for c in got] == [(0, 10, 0), (1, 0, 1)]
