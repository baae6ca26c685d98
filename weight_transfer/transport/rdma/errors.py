"""Work-completion status -> exception, naming the peer, the region and the verbs status.

``ibv_wc_status`` values and their texts (those of ``ibv_wc_status_str``) are a
table here so the mapping is pure and tested without a device; a test checks the
table against the installed pyverbs. The classes:

- :class:`RemoteAccessError`: the target refused the write (wrong rkey, range
  outside the MR, MR deregistered, QP without remote-write access);
- :class:`PeerUnreachableError`: no acknowledgement came back (process dead,
  link down, QP of the peer not connected);
- :class:`TransportError`: everything else, flushed work requests included.

Which failures are transient (retried under the executor's policy): an
``ibv_post_send`` refused for want of resources (``ENOMEM``, ``EAGAIN``,
``EBUSY``, ``ENOBUFS``: the send queue is full for now) raises
:class:`RdmaQueueFullError`; the QP stays usable. A failed *completion* is never
transient here, whatever its status (retry exceeded, response timeout ...): it
moves the RC queue pair to the error state, and only a new ``connect`` of both
sides recovers it, so trying the same WRITE again on it cannot succeed (RNR
errors do not occur at all: RDMA WRITEs consume no receive requests).
"""

from __future__ import annotations

import errno

from weight_transfer.transport.base import (
    PeerUnreachableError,
    RemoteAccessError,
    TransientTransportError,
    TransportError,
)
from weight_transfer.types import RegionDesc

TRANSIENT_POST_ERRNOS = frozenset({errno.ENOMEM, errno.EAGAIN, errno.EBUSY, errno.ENOBUFS})


class RdmaQueueFullError(TransientTransportError):
    """``ibv_post_send`` was refused for want of resources (send queue full): transient."""


IBV_WC_SUCCESS = 0
IBV_WC_WR_FLUSH_ERR = 5

# status -> (enum name, ibv_wc_status_str text)
WC_STATUS: dict[int, tuple[str, str]] = {
    0: ("IBV_WC_SUCCESS", "success"),
    1: ("IBV_WC_LOC_LEN_ERR", "local length error"),
    2: ("IBV_WC_LOC_QP_OP_ERR", "local QP op error"),
    3: ("IBV_WC_LOC_EEC_OP_ERR", "local EEC op error"),
    4: ("IBV_WC_LOC_PROT_ERR", "local protection error"),
    5: ("IBV_WC_WR_FLUSH_ERR", "WR flush error"),
    6: ("IBV_WC_MW_BIND_ERR", "memory window bind error"),
    7: ("IBV_WC_BAD_RESP_ERR", "bad response error"),
    8: ("IBV_WC_LOC_ACCESS_ERR", "local access error"),
    9: ("IBV_WC_REM_INV_REQ_ERR", "remote invalidate request error"),
    10: ("IBV_WC_REM_ACCESS_ERR", "remote access error"),
    11: ("IBV_WC_REM_OP_ERR", "remote op error"),
    12: ("IBV_WC_RETRY_EXC_ERR", "retry exceeded error"),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "RNR retry exceeded"),
    14: ("IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation error"),
    15: ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalidate RD request error"),
    16: ("IBV_WC_REM_ABORT_ERR", "remote abort error"),
    17: ("IBV_WC_INV_EECN_ERR", "invalidate EECN error"),
    18: ("IBV_WC_INV_EEC_STATE_ERR", "invalidate EEC state error"),
    19: ("IBV_WC_FATAL_ERR", "WC fatal error"),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout error"),
    21: ("IBV_WC_GENERAL_ERR", "general error"),
}

_REMOTE_REFUSED = {9, 10}  # REM_INV_REQ (e.g. length beyond the MR), REM_ACCESS (rkey)
_UNREACHABLE = {12, 13, 20}  # retries / RNR retries exhausted, response timeout

_HINTS: dict[int, str] = {
    10: "wrong rkey, range outside the region, or region deregistered on the target",
    9: "the target rejected the request (range outside the region or no remote write)",
    12: "no acknowledgement: target process dead, link down, or its QP not connected",
    13: "the target QP was not ready to receive",
    20: "the target stopped responding",
    5: "flushed: an earlier work request on this connection failed",
    4: "the local source is not covered by its memory region (lkey)",
    8: "the local memory region does not allow this access",
}


def wc_status_str(status: int) -> str:
    """The verbs text of a completion status (``ibv_wc_status_str``)."""
    return WC_STATUS.get(status, ("", "Unknown CQE status"))[1]


def wc_status_name(status: int) -> str:
    return WC_STATUS.get(status, (f"IBV_WC_STATUS_{status}", ""))[0]


def completion_error(
    status: int,
    *,
    peer: str,
    region: RegionDesc,
    offset: int,
    nbytes: int,
    vendor_err: int = 0,
) -> TransportError:
    """The exception for a failed RDMA WRITE of ``nbytes`` at ``offset`` into ``region``."""
    if status == IBV_WC_SUCCESS:
        raise ValueError("completion_error called for a successful completion")
    if status in _REMOTE_REFUSED:
        cls: type[TransportError] = RemoteAccessError
    elif status in _UNREACHABLE:
        cls = PeerUnreachableError
    else:
        cls = TransportError
    hint = _HINTS.get(status, "see the device's vendor error code")
    return cls(
        f"RDMA WRITE to peer {peer!r} failed: {wc_status_str(status)} "
        f"({wc_status_name(status)}, vendor_err={vendor_err:#x}) writing {nbytes} B at "
        f"offset {offset} of {region.describe()}: {hint}"
    )


def post_error(exc: BaseException, *, owner: str, nbytes: int,
               region: RegionDesc) -> TransportError:
    """The exception for an ``ibv_post_send`` that raised ``exc`` (pyverbs: its
    ``error_code`` is the errno); transient when the send queue was only full."""
    code = getattr(exc, "error_code", None)
    if code is None and len(getattr(exc, "args", ())) > 1:
        code = exc.args[1]
    what = f"{owner}: posting an RDMA WRITE of {nbytes} B to {region.describe()} failed: {exc}"
    if code in TRANSIENT_POST_ERRNOS:
        return RdmaQueueFullError(f"{what} ({errno.errorcode[code]}: send queue full for now)")
    return TransportError(what)
