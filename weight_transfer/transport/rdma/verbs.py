"""Thin pyverbs glue: import, open a device/port, build QPs, MRs and work requests.

Everything that touches pyverbs lives here, each function small and explicit;
the decisions (which attributes, which chunks, which exception) are made by the
pure modules ``rdma_wire``, ``rdma_plan``, ``rdma_errors``.

- :func:`import_pyverbs` returns the pyverbs modules or raises
  :class:`RdmaUnavailableError` saying how to install them;
- :func:`open_device` opens a device (by name, or the first one) and checks the
  port; without a device it raises :class:`RdmaUnavailableError` that names the
  device asked for and points at the simnic transport;
- :func:`rdma_unavailable_reason` says why RDMA cannot run here (or None): the
  tests skip on it and ``wt selftest`` prints it.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from weight_transfer.errors import WeightTransferError
from weight_transfer.transport.rdma.plan import Chunk
from weight_transfer.transport.rdma.window import Completion
from weight_transfer.transport.rdma.wire import MTU_ENUM, QpConnectAttrs

log = logging.getLogger(__name__)

PYVERBS_MODULES = ("addr", "cq", "device", "enums", "mr", "pd", "pyverbs_error", "qp", "wr")
INSTALL_HINT = (
    "install Debian's python3-pyverbs (apt-get install python3-pyverbs, rdma-core 44) and "
    "run `python scripts/setup_pyverbs.py` to expose it inside the virtual environment"
)
IBV_LINK_LAYER_ETHERNET = 2
IBV_PORT_ACTIVE = 4


class RdmaUnavailableError(WeightTransferError, RuntimeError):
    """RDMA cannot be used here: pyverbs missing, no device, or the port is not usable."""


def import_pyverbs() -> SimpleNamespace:
    """The pyverbs modules as one namespace (``pv.qp.QP``, ``pv.enums``...)."""
    mods = {}
    for name in PYVERBS_MODULES:
        try:
            mods[name] = importlib.import_module(f"pyverbs.{name}")
        except ImportError as exc:
            raise RdmaUnavailableError(
                f"the rdma transport needs pyverbs, which is not importable ({exc}): "
                f"{INSTALL_HINT}"
            ) from exc
    return SimpleNamespace(**mods)


def list_devices(pv: SimpleNamespace) -> list[str]:
    """Names of the RDMA devices of this machine (empty when there are none)."""
    try:
        devices = pv.device.get_device_list()
    except pv.pyverbs_error.PyverbsError:  # rdma-core 44 raises when the list is empty
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


def no_device_message(device: str | None) -> str:
    asked = f"device {device!r}" if device else "the first device"
    return (
        f"no RDMA device found (asked for {asked}): ibv_get_device_list() lists none, this "
        "machine has no InfiniBand/RoCE device (see /sys/class/infiniband); "
        "use the simnic transport here: make_transport('simnic', ...)"
    )


def pick_device(available: list[str], device: str | None) -> str:
    """The device to open: ``device`` if present, else the first one."""
    if not available:
        raise RdmaUnavailableError(no_device_message(device))
    if device is None:
        return available[0]
    if device not in available:
        raise RdmaUnavailableError(f"RDMA device {device!r} not found; available: {available}")
    return device


def rdma_unavailable_reason(device: str | None = None) -> str | None:
    """Why the rdma transport cannot run here, or None when a device is there."""
    try:
        pick_device(list_devices(import_pyverbs()), device)
    except RdmaUnavailableError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class PortInfo:
    """What the transport needs to know of the port it uses (plain numbers)."""

    lid: int
    gid: str
    mtu: int  # bytes
    roce: bool
    max_msg_sz: int
    max_qp_wr: int


def open_device(pv: SimpleNamespace, device: str | None, port: int, gid_index: int):
    """Open ``device`` (or the first one); returns (name, Context, PortInfo)."""
    name = pick_device(list_devices(pv), device)
    ctx = pv.device.Context(name=name)
    try:
        return name, ctx, query_port(pv, ctx, name, port, gid_index)
    except BaseException:
        ctx.close()
        raise


def query_port(pv: SimpleNamespace, ctx: Any, name: str, port: int, gid_index: int) -> PortInfo:
    dev_attr = ctx.query_device()
    if not 1 <= port <= dev_attr.phys_port_cnt:
        raise ValueError(f"{name} has ports 1..{dev_attr.phys_port_cnt}, not {port}")
    attr = ctx.query_port(port)
    if attr.state != IBV_PORT_ACTIVE:
        raise RdmaUnavailableError(
            f"port {port} of {name} is not active ({pv.device.port_state_to_str(attr.state)})"
        )
    if not 0 <= gid_index < attr.gid_tbl_len:
        raise ValueError(f"gid_index {gid_index} is outside the GID table of {name} port "
                         f"{port} (0..{attr.gid_tbl_len - 1})")
    mtu = {v: k for k, v in MTU_ENUM.items()}[int(attr.active_mtu)]
    return PortInfo(
        lid=attr.lid,
        gid=str(ctx.query_gid(port, gid_index)),
        mtu=mtu,
        roce=attr.link_layer == IBV_LINK_LAYER_ETHERNET,
        max_msg_sz=attr.max_msg_sz,
        max_qp_wr=dev_attr.max_qp_wr,
    )


def create_rc_qp(pv: SimpleNamespace, pd: Any, cq: Any, max_send_wr: int) -> Any:
    """An RC QP in RESET whose send completions (signaled WRs only) go to ``cq``."""
    cap = pv.qp.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    init = pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
    return pv.qp.QP(pd, init)


def to_qp_attr(pv: SimpleNamespace, a: QpConnectAttrs) -> Any:
    """A pyverbs ``QPAttr`` holding every field of ``a``."""
    attr = pv.qp.QPAttr(port_num=a.port_num, path_mtu=a.path_mtu)
    for name in ("pkey_index", "dest_qp_num", "rq_psn", "sq_psn", "max_dest_rd_atomic",
                 "max_rd_atomic", "min_rnr_timer", "timeout", "retry_cnt", "rnr_retry"):
        setattr(attr, name, getattr(a, name))
    attr.qp_access_flags = a.access_flags
    gr = None
    if a.is_global:
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(a.dgid), sgid_index=a.sgid_index,
                                 hop_limit=a.hop_limit, traffic_class=a.traffic_class)
    attr.ah_attr = pv.addr.AHAttr(port_num=a.port_num, is_global=a.is_global, gr=gr,
                                  dlid=a.dlid, sl=a.sl)
    return attr


def qp_state(pv: SimpleNamespace, qp: Any) -> int:
    """The QP's state as the device sees it (an error moves it to ERR behind our back)."""
    attr, _ = qp.query(pv.enums.IBV_QP_STATE)
    return int(attr.qp_state)


def connect_qp(pv: SimpleNamespace, qp: Any, attrs: QpConnectAttrs, where: str) -> None:
    """Bring ``qp`` from any state through RESET, INIT and RTR to RTS."""
    if qp_state(pv, qp) != pv.enums.IBV_QPS_RESET:
        qp.modify(pv.qp.QPAttr(qp_state=pv.enums.IBV_QPS_RESET), pv.enums.IBV_QP_STATE)
    attr = to_qp_attr(pv, attrs)
    for step in (qp.to_init, qp.to_rtr, qp.to_rts):
        try:
            step(attr)
        except pv.pyverbs_error.PyverbsError as exc:
            raise RdmaUnavailableError(f"{where}: {step.__name__} failed: {exc}") from exc


def register_mr(pv: SimpleNamespace, pd: Any, addr: int, length: int, access: int) -> Any:
    return pv.mr.MR(pd, length, access, address=addr)


def register_dmabuf_mr(
    pv: SimpleNamespace, pd: Any, fd: int, offset: int, length: int, access: int
) -> Any:
    """An MR over ``[offset, offset+length)`` of a dma-buf; its iova is ``offset``."""
    return pv.mr.DmaBufMR(pd, length, access, dmabuf=fd, offset=offset)


def post_write(pv: SimpleNamespace, qp: Any, wr_id: int, sge_addr: int, lkey: int,
               chunk: Chunk, rkey: int) -> None:
    """Post one signaled IBV_WR_RDMA_WRITE of ``chunk`` to ``rkey`` at ``chunk.dst``."""
    sge = pv.wr.SGE(sge_addr, chunk.length, lkey)
    wr = pv.wr.SendWR(wr_id=wr_id, opcode=pv.enums.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                      send_flags=pv.enums.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, chunk.dst)
    qp.post_send(wr)


def poll_cq(cq: Any, max_entries: int) -> list[Completion]:
    npolled, wcs = cq.poll(max_entries)
    return [Completion(wc.wr_id, int(wc.status), wc.vendor_err) for wc in wcs[:npolled]]
