"""RDMA connection data: the endpoint a peer publishes and the QP attributes built from it.

Pure functions, no pyverbs: they are unit-tested on machines without a device.

Setup of one RC connection between a writer W and a target T (both call the same
two methods of their :class:`~weight_transfer.transport.rdma.transport.RdmaTransport`)::

    info_w = W.peer_info("T")     # W creates its QP dedicated to T
    info_t = T.peer_info("W")     # T creates its QP dedicated to W
    W.connect(info_t); T.connect(info_w)   # INIT -> RTR -> RTS with these fields

``PeerInfo.endpoint`` holds :class:`RdmaEndpoint` as a plain dict
(``lid, gid, qpn, psn, port, mtu, peer``); :func:`parse_endpoint` validates it,
:func:`encode_peer` / :func:`decode_peer` move a whole ``PeerInfo`` as msgpack
bytes, and :func:`build_qp_attrs` turns both endpoints into the plain numbers of
the three ``ibv_modify_qp`` transitions (:class:`QpConnectAttrs`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from weight_transfer.types import PeerInfo

# Values of the libibverbs enums used here (checked against pyverbs in the tests).
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_WRITE = 2
MTU_ENUM: dict[int, int] = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}  # bytes -> ibv_mtu
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
MAX_24BIT = (1 << 24) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RdmaEndpoint:
    """One side of an RC connection: what the other side needs to reach this QP.

    ``peer`` is the owner this QP was created for: a ``PeerInfo`` handed to the
    wrong process is refused at ``connect`` instead of silently mis-wiring QPs.
    ``mtu`` is in bytes (256..4096), ``gid`` in pyverbs' 8x4-hex-digit format.
    """

    lid: int
    gid: str
    qpn: int
    psn: int
    port: int
    mtu: int
    peer: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ENDPOINT_FIELDS = tuple(f.name for f in fields(RdmaEndpoint))


def normalize_gid(text: str) -> str:
    """A GID in pyverbs' format (``fe80:0000:...:0001``); accepts any IPv6 notation."""
    try:
        return ipaddress.IPv6Address(text).exploded
    except (ipaddress.AddressValueError, ValueError):
        raise ValueError(f"GID {text!r} is not a 128-bit address like fe80::1") from None


def is_zero_gid(gid: str) -> bool:
    return normalize_gid(gid) == ZERO_GID


def _int_field(where: str, ep: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = ep[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: endpoint field {name!r} = {value!r} must be an integer")
    if not lo <= value <= hi:
        raise ValueError(f"{where}: endpoint field {name!r} = {value} must be in [{lo}, {hi}]")
    return value


def parse_endpoint(peer: PeerInfo) -> RdmaEndpoint:
    """Validate an rdma ``PeerInfo`` and return its endpoint; ValueError names the field."""
    where = f"PeerInfo from {peer.owner!r} (nic {peer.nic!r})"
    if peer.transport != "rdma":
        raise ValueError(f"{where} is for transport {peer.transport!r}, not 'rdma'")
    ep = peer.endpoint
    if not isinstance(ep, dict):
        raise ValueError(f"{where}: endpoint must be a dict, not {type(ep).__name__}")
    missing = [name for name in ENDPOINT_FIELDS if name not in ep]
    if missing:
        raise ValueError(f"{where}: endpoint lacks {missing} (has {sorted(ep)})")
    mtu = _int_field(where, ep, "mtu", 256, 4096)
    if mtu not in MTU_ENUM:
        raise ValueError(f"{where}: endpoint field 'mtu' = {mtu} must be one of {list(MTU_ENUM)}")
    if not isinstance(ep["gid"], str):
        raise ValueError(f"{where}: endpoint field 'gid' = {ep['gid']!r} must be a string")
    if not isinstance(ep["peer"], str) or not ep["peer"]:
        raise ValueError(f"{where}: endpoint field 'peer' = {ep['peer']!r} must name an owner")
    try:
        gid = normalize_gid(ep["gid"])
    except ValueError as exc:
        raise ValueError(f"{where}: endpoint field 'gid': {exc}") from None
    return RdmaEndpoint(
        lid=_int_field(where, ep, "lid", 0, 0xFFFF),
        gid=gid,
        qpn=_int_field(where, ep, "qpn", 1, MAX_24BIT),
        psn=_int_field(where, ep, "psn", 0, MAX_24BIT),
        port=_int_field(where, ep, "port", 1, 255),
        mtu=mtu,
        peer=ep["peer"],
    )


def make_peer_info(*, owner: str, nic: str, endpoint: RdmaEndpoint) -> PeerInfo:
    return PeerInfo(owner=owner, nic=nic, transport="rdma", endpoint=endpoint.to_dict())


def encode_peer(peer: PeerInfo) -> bytes:
    """A ``PeerInfo`` as msgpack bytes (for a control plane that moves bytes)."""
    return msgpack.packb(
        {"owner": peer.owner, "nic": peer.nic, "transport": peer.transport,
         "endpoint": dict(peer.endpoint)}
    )


def decode_peer(data: bytes) -> PeerInfo:
    """Inverse of :func:`encode_peer`; an rdma endpoint is validated on the way in."""
    try:
        raw = msgpack.unpackb(data)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ValueError(f"PeerInfo bytes are not msgpack: {exc}") from None
    keys = {"owner", "nic", "transport", "endpoint"}
    if not isinstance(raw, dict) or set(raw) != keys:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"PeerInfo bytes must hold exactly {sorted(keys)}, got {got}")
    peer = PeerInfo(owner=raw["owner"], nic=raw["nic"], transport=raw["transport"],
                    endpoint=raw["endpoint"])
    if peer.transport == "rdma":
        parse_endpoint(peer)
    return peer


@dataclass(frozen=True, slots=True, kw_only=True)
class QpConnectAttrs:
    """Everything the RESET -> INIT -> RTR -> RTS transitions of one RC QP set."""

    port_num: int
    pkey_index: int
    access_flags: int
    path_mtu: int  # ibv_mtu enum value
    dest_qp_num: int
    rq_psn: int
    sq_psn: int
    max_dest_rd_atomic: int
    max_rd_atomic: int
    min_rnr_timer: int
    timeout: int
    retry_cnt: int
    rnr_retry: int
    dlid: int
    is_global: int
    dgid: str
    sgid_index: int
    hop_limit: int
    traffic_class: int
    sl: int


def build_qp_attrs(
    local: RdmaEndpoint,
    remote: RdmaEndpoint,
    *,
    gid_index: int,
    roce: bool,
    timeout: int = 14,
    retry_cnt: int = 7,
    rnr_retry: int = 7,
) -> QpConnectAttrs:
    """QP attributes for connecting ``local`` to ``remote`` (same values as ibv_rc_pingpong).

    The path MTU is the smaller of both ports' MTUs. RoCE (Ethernet link layer)
    routes by GID only, so both GIDs must be set; InfiniBand routes by LID and
    adds a GRH when the peer has a GID. ``timeout`` 14 is 4.096 us * 2**14 = 67 ms
    per try, ``retry_cnt`` 7 tries: a dead peer fails a write in about 0.5 s.
    """
    _check_routable(local, remote, gid_index=gid_index, roce=roce)
    is_global = 0 if is_zero_gid(remote.gid) else 1
    return QpConnectAttrs(
        port_num=local.port,
        pkey_index=0,
        access_flags=IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
        path_mtu=MTU_ENUM[min(local.mtu, remote.mtu)],
        dest_qp_num=remote.qpn,
        rq_psn=remote.psn,
        sq_psn=local.psn,
        max_dest_rd_atomic=1,
        max_rd_atomic=1,
        min_rnr_timer=12,
        timeout=timeout,
        retry_cnt=retry_cnt,
        rnr_retry=rnr_retry,
        dlid=remote.lid,
        is_global=is_global,
        dgid=remote.gid,
        sgid_index=gid_index,
        hop_limit=255 if is_global else 0,
        traffic_class=0,
        sl=0,
    )


def _check_routable(local: RdmaEndpoint, remote: RdmaEndpoint, *, gid_index: int,
                    roce: bool) -> None:
    who = f"peer {local.peer!r}"
    if roce and (is_zero_gid(remote.gid) or is_zero_gid(local.gid)):
        raise ValueError(
            f"RoCE needs a GID on both sides: {who} published {remote.gid}, this side "
            f"{local.gid} (gid_index {gid_index}); pick a gid_index that carries an IP address"
        )
    if not roce and remote.lid == 0:
        raise ValueError(f"{who} has LID 0 on port {remote.port}: its InfiniBand port has no "
                         "LID (is a subnet manager running?)")
    if not 0 <= gid_index <= 255:
        raise ValueError(f"gid_index {gid_index} must be in [0, 255]")
