"""Real RDMA WRITE through pyverbs: one RC queue pair per peer, one CQ per transport.

``make_transport("rdma", owner=..., nic=..., device=None, port=1, gid_index=0,
max_inflight=16)`` opens the device (by name, or the first one), a protection
domain and a completion queue. Then, as for every transport:

1. the target ``register``-s memory: CPU memory (tensor, numpy array, writable
   buffer) as an MR with LOCAL_WRITE | REMOTE_WRITE; a CUDA tensor through a
   dma-buf MR (see ``rdma_cuda``). The ``RegionDesc`` carries the rkey and the
   address the MR is addressed by: the virtual address, or for GPU memory the
   offset in the dma-buf (the MR's iova);
2. both sides call ``peer_info(other_owner, other_nic)`` (creates the QP
   dedicated to that peer NIC; ``other_nic`` None: the owner's only NIC),
   exchange the results and ``connect`` (INIT -> RTR -> RTS); either order
   works, ``connect`` creates the QP too when it comes first. One QP per
   (local NIC, remote NIC) pair: a peer with several NICs gets one per NIC
   (``weight_transfer.transport.handshake`` does this for a whole cluster);
3. the writer awaits ``write(src, dst, offset)``: the bytes go as signaled
   ``IBV_WR_RDMA_WRITE`` work requests of at most ``chunk_bytes`` (and the
   port's max message size), with at most ``max_inflight`` outstanding per
   transport; the CQ is polled from the event loop (``rdma_window``). Failed
   completions raise RemoteAccessError / PeerUnreachableError / TransportError
   naming the peer, the region and the verbs status (``rdma_errors``).

Sources: a source inside memory registered on this transport (``register``,
or ``register_source`` for memory only written from: one MR with local access,
e.g. the staging arena of ``weight_transfer.sender.staging``) posts with that MR; any
other source is registered for the duration of the write and deregistered when
its work requests complete. MRs are deliberately not cached by address: once a
buffer is freed its address may come back from the allocator with other pages
behind it, and a cached MR would then send the old pages. Register long-lived
staging buffers up front on the hot path. ``supports_device_memory`` is True
where GPU memory can be registered (CUDA dma-buf): callers then keep their
sources on the GPU. ``registrations`` counts every MR ever made (tests check
that the hot path makes none).

Transient errors (:mod:`.rdma_errors`): only a post refused for want of
resources (send queue full); a failed completion leaves the QP in the error
state. ``disconnect(owner, nic)`` closes the QPs to a peer (call it with no write
to that peer in flight: the controller removes a replica between updates).

After a failed completion the QP is in the error state: later writes to that
peer raise PeerUnreachableError until both sides ``connect`` again (the same
``PeerInfo`` can be reused: connect resets the QP). Without pyverbs or without a
device, construction raises ``RdmaUnavailableError`` (a RuntimeError) that says
what to install or that simnic is the transport to use.

``verbs`` (default: the pyverbs modules from ``rdma_verbs.import_pyverbs``) is
the verbs provider; the unit tests pass an in-process model of a device.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pydantic import Field

from weight_transfer.transport.base import (
    PeerUnreachableError,
    TransportBase,
    TransportError,
    TransportOptions,
    source_buffer,
    target_buffer,
)
from weight_transfer.transport.rdma.cuda import dmabuf_unsupported_reason, export_dmabuf
from weight_transfer.transport.rdma.errors import completion_error, post_error
from weight_transfer.transport.rdma.plan import LocalRegion, LocalRegions, split_write
from weight_transfer.transport.rdma.verbs import (
    PortInfo,
    connect_qp,
    create_rc_qp,
    import_pyverbs,
    open_device,
    poll_cq,
    post_write,
    qp_state,
    register_dmabuf_mr,
    register_mr,
)
from weight_transfer.transport.rdma.window import CompletionWindow
from weight_transfer.transport.rdma.wire import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_WRITE,
    RdmaEndpoint,
    build_qp_attrs,
    make_peer_info,
    parse_endpoint,
)
from weight_transfer.types import PeerInfo, RegionDesc

log = logging.getLogger(__name__)
TARGET_ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE


class RdmaOptions(TransportOptions):
    """pyverbs RC queue pairs: device (None: the first), port, GID index (RoCE needs one)."""

    device: str | None = None
    port: int = Field(default=1, ge=1)
    gid_index: int = Field(default=0, ge=0)
    max_inflight: int = Field(default=16, ge=1)
    chunk_bytes: int = Field(default=16 << 20, ge=1)
    timeout: int = Field(default=14, ge=0, le=31)
    retry_cnt: int = Field(default=7, ge=0, le=7)


@dataclass(slots=True)
class _Registration:
    mr: Any
    local: LocalRegion
    keepalive: Any
    fd: int = -1

    def close(self) -> None:
        self.mr.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(slots=True)
class _Conn:
    qp: Any
    local: RdmaEndpoint
    remote: RdmaEndpoint | None = None
    error: str | None = None


class RdmaTransport(TransportBase):
    """One RDMA port of one process. See the module docstring for the call order."""

    kind = "rdma"
    Options = RdmaOptions
    registers_sources = True  # writes post from registered memory (register_source)

    def __init__(self, *, owner: str, nic: str | None = None, device: str | None = None,
                 port: int = 1, gid_index: int = 0, max_inflight: int = 16,
                 chunk_bytes: int = 16 << 20, node: str = "", timeout: int = 14,
                 retry_cnt: int = 7, verbs: SimpleNamespace | None = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self._pv = pv = verbs if verbs is not None else import_pyverbs()
        self.device, self._ctx, self._port = open_device(pv, device, port, gid_index)
        try:
            if not 1 <= max_inflight <= self._port.max_qp_wr:
                raise ValueError(f"max_inflight {max_inflight} must be in [1, "
                                 f"{self._port.max_qp_wr}] (max_qp_wr of {self.device})")
            self._pd = pv.pd.PD(self._ctx)
            self._cq = pv.cq.CQ(self._ctx, max_inflight + 16, None, None, 0)
        except BaseException:
            self._ctx.close()
            raise
        super().__init__(owner=owner, nic=nic or self.device)
        self.node = node
        self.port, self.gid_index, self.max_inflight = port, gid_index, max_inflight
        self.chunk_bytes = min(chunk_bytes, self._port.max_msg_sz)
        self._qp_opts = {"timeout": timeout, "retry_cnt": retry_cnt}
        self._window: CompletionWindow = CompletionWindow(
            lambda n: poll_cq(self._cq, n), max_inflight=max_inflight)
        self.bytes_written = self.writes = 0  # writes this NIC completed, and their bytes
        self._regs: dict[tuple[int, int], _Registration] = {}
        self._sources: dict[int, _Registration] = {}  # register_source handles
        self.registrations = 0  # MRs made so far, temporary ones included
        self._local = LocalRegions()
        self._closed = False
        log.info("rdma %s: %s port %d open (%s, MTU %d, lid %d, gid %s)", owner, self.device,
                 port, "RoCE" if self._port.roce else "InfiniBand", self._port.mtu,
                 self._port.lid, self._port.gid)

    # ------------------------------------------------------------------ memory

    def register(self, buf: Any) -> RegionDesc:
        """Expose ``buf`` for remote WRITE; CUDA tensors go through a dma-buf MR."""
        reg = self._register(buf, TARGET_ACCESS)
        self._regs[(reg.local.iova, reg.mr.rkey)] = reg
        self._local.add(reg.local)
        return RegionDesc(owner=self.owner, nic=self.nic, addr=reg.local.iova,
                          length=reg.local.length, rkey=reg.mr.rkey, transport="rdma",
                          node=self.node)

    def deregister(self, desc: RegionDesc) -> None:
        """Close the MR: later writes to ``desc`` fail with a remote access error."""
        reg = None if desc.owner != self.owner else self._regs.pop((desc.addr, desc.rkey), None)
        if reg is None:
            raise ValueError(f"{desc.describe()} is not registered on {self.owner}/{self.nic}")
        self._local.remove(reg.local)
        reg.close()

    def register_source(self, buf: Any) -> int:
        """Register memory that writes read from (not exposed to peers), once, at setup.

        Writes whose source lies inside it post with its MR. Returns a handle for
        :meth:`deregister_source`.
        """
        reg = self._register(buf, IBV_ACCESS_LOCAL_WRITE)
        handle = id(reg)
        self._sources[handle] = reg
        self._local.add(reg.local)
        return handle

    def deregister_source(self, handle: int) -> None:
        reg = self._sources.pop(handle, None)
        if reg is None:
            raise ValueError(f"{self.owner}: no source registration {handle:#x}")
        self._local.remove(reg.local)
        reg.close()

    @property
    def supports_device_memory(self) -> bool:
        """True when this host registers GPU memory through dma-buf (sources stay on GPU)."""
        return dmabuf_unsupported_reason() is None

    def _register(self, buf: Any, access: int) -> _Registration:
        self.registrations += 1
        if getattr(buf, "is_cuda", False):
            return self._register_cuda(buf, access)
        tb = target_buffer(buf) if access & IBV_ACCESS_REMOTE_WRITE else source_buffer(buf)
        try:
            mr = register_mr(self._pv, self._pd, tb.addr, tb.nbytes, access)
        except self._pv.pyverbs_error.PyverbsError as exc:
            raise TransportError(
                f"{self.owner}: registering {tb.nbytes} B at {tb.addr:#x} on {self.device} "
                f"failed: {exc} (is `ulimit -l` large enough to pin it?)") from exc
        local = LocalRegion(va=tb.addr, length=tb.nbytes, lkey=mr.lkey, iova=tb.addr)
        return _Registration(mr=mr, local=local, keepalive=tb.keepalive)

    def _register_cuda(self, tensor: Any, access: int) -> _Registration:
        sb = target_buffer(tensor)  # checks contiguity and emptiness
        span = export_dmabuf(sb.addr, sb.nbytes, device=tensor.device.index or 0)
        try:
            mr = register_dmabuf_mr(self._pv, self._pd, span.fd, span.offset, sb.nbytes, access)
        except BaseException as exc:
            os.close(span.fd)
            if isinstance(exc, self._pv.pyverbs_error.PyverbsError):
                raise TransportError(
                    f"{self.owner}: dma-buf registration of {sb.nbytes} B of {tensor.device} "
                    f"on {self.device} failed: {exc}") from exc
            raise
        local = LocalRegion(va=sb.addr, length=sb.nbytes, lkey=mr.lkey, iova=span.offset)
        return _Registration(mr=mr, local=local, keepalive=tensor, fd=span.fd)

    # ------------------------------------------------------------------ connections

    def peer_info(self, remote_owner: str, remote_nic: str | None = None) -> PeerInfo:
        """Create (or return) the QP dedicated to NIC ``remote_nic`` of ``remote_owner``
        (None: its only NIC); give the result to that NIC."""
        conn = self._conn(remote_owner, remote_nic)
        return make_peer_info(owner=self.owner, nic=self.nic, endpoint=conn.local)

    def _conn(self, owner: str, nic: str | None) -> _Conn:
        """The QP for NIC ``nic`` of ``owner``, created on first use.

        A QP made for ``nic`` None (any NIC of ``owner``) is bound to the first
        NIC of that owner that asks or connects; a lookup with ``nic`` None
        finds the owner's only QP.
        """
        conns = self._peers  # the peer table: (owner, nic) -> _Conn, QPs not yet connected too
        with self._peers_lock:
            conn = conns.get((owner, nic))
            if conn is None and nic is not None and (owner, None) in conns:
                conn = conns[(owner, nic)] = conns.pop((owner, None))
            if conn is None and nic is None:
                mine = [c for (o, _), c in conns.items() if o == owner]
                conn = mine[0] if len(mine) == 1 else None
        if conn is None:
            qp = create_rc_qp(self._pv, self._pd, self._cq, self.max_inflight)
            ep = RdmaEndpoint(lid=self._port.lid, gid=self._port.gid, qpn=qp.qp_num,
                              psn=secrets.randbits(24), port=self.port, mtu=self._port.mtu,
                              peer=owner)
            conn = _Conn(qp=qp, local=ep)
            self._add_peer(owner, nic, conn)
        return conn

    def connect(self, peer: PeerInfo) -> None:
        """Bring the QP for ``peer.owner`` to RTS; again after an error, to recover.

        ``connect`` and ``peer_info`` may come in either order: both create the QP
        dedicated to the peer when it does not exist yet.
        """
        ep = parse_endpoint(peer)
        if ep.peer != self.owner:
            raise ValueError(f"PeerInfo from {peer.owner!r} was made for {ep.peer!r}, not for "
                             f"{self.owner!r}: ask {peer.owner!r} for peer_info({self.owner!r})")
        conn = self._conn(peer.owner, peer.nic)
        pv = self._pv
        if conn.remote == ep and conn.error is None and \
                qp_state(pv, conn.qp) == pv.enums.IBV_QPS_RTS:
            return
        attrs = build_qp_attrs(conn.local, ep, gid_index=self.gid_index, roce=self._port.roce,
                               **self._qp_opts)
        connect_qp(pv, conn.qp, attrs, f"{self.owner} -> {peer.owner} ({self.device} port "
                                       f"{self.port}, qpn {conn.local.qpn} -> {ep.qpn})")
        conn.remote, conn.error = ep, None

    def _is_connected(self, conn: _Conn) -> bool:
        return conn.remote is not None

    def _release_peer(self, conn: _Conn) -> None:
        conn.qp.close()

    def _conn_for(self, dst: RegionDesc) -> _Conn:
        conn = self._peer_for(dst)
        if conn.error is not None:
            raise PeerUnreachableError(
                f"connection {self.owner} -> {dst.owner!r} failed earlier ({conn.error}); "
                f"connect() both sides again before writing to {dst.describe()}")
        return conn

    # ------------------------------------------------------------------ data path

    async def write(self, src: Any, dst: RegionDesc, dst_offset: int = 0) -> None:
        """One-sided RDMA WRITE of all of ``src`` into ``dst`` at ``dst_offset``."""
        self._check_region(dst)
        sb = source_buffer(src)
        self._check_destination(dst, dst_offset, sb.nbytes)
        if sb.nbytes == 0:
            return
        conn = self._conn_for(dst)
        local = self._local.find(sb.addr, sb.nbytes)
        temp = None
        if local is None:
            temp = self._register(src if getattr(src, "is_cuda", False) else (sb.addr, sb.nbytes),
                                  IBV_ACCESS_LOCAL_WRITE)
            local = temp.local
        chunks = split_write(src=sb.addr, dst=dst.addr + dst_offset, nbytes=sb.nbytes,
                             max_bytes=self.chunk_bytes)
        try:
            failed = await self._window.run(chunks, self._poster(conn, local, dst))
        finally:
            if temp is not None:
                temp.close()
        if failed is not None:
            chunk, wc = failed
            exc = completion_error(wc.status, peer=dst.owner, region=dst, nbytes=chunk.length,
                                   offset=chunk.dst - dst.addr, vendor_err=wc.vendor_err)
            conn.error = str(exc)
            raise exc
        self.bytes_written += sb.nbytes
        self.writes += 1

    def _poster(self, conn: _Conn, local: LocalRegion, dst: RegionDesc):
        pv, qp = self._pv, conn.qp

        def post(wr_id: int, chunk: Any) -> None:
            try:
                post_write(pv, qp, wr_id, local.sge_addr(chunk.src), local.lkey, chunk, dst.rkey)
            except pv.pyverbs_error.PyverbsError as exc:
                err = post_error(exc, owner=self.owner, nbytes=chunk.length, region=dst)
                if not self.is_transient(err):  # a full send queue leaves the QP usable
                    conn.error = f"ibv_post_send failed: {exc}"
                raise err from exc
        return post

    @property
    def port_info(self) -> PortInfo:
        """LID, GID, MTU, link layer and limits of the port in use."""
        return self._port

    @property
    def peak_inflight(self) -> int:
        """Most work requests that were outstanding at once (at most ``max_inflight``)."""
        return self._window.peak

    def close(self) -> None:
        """Release every MR, QP, the CQ, PD and device context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for reg in (*self._regs.values(), *self._sources.values()):
            reg.close()
        self._regs.clear()
        self._sources.clear()
        for conn in self._take_peers():
            conn.qp.close()
        self._cq.close()
        self._pd.close()
        self._ctx.close()
