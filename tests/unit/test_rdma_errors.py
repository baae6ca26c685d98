"""Work-completion status -> exception class and message."""

from __future__ import annotations

import pytest

from weight_transfer.transport.base import (
    PeerUnreachableError,
    RemoteAccessError,
    TransportError,
)
from weight_transfer.transport.rdma.errors import (
    WC_STATUS,
    completion_error,
    wc_status_name,
    wc_status_str,
)
from weight_transfer.types import RegionDesc

REGION = RegionDesc(owner="engine0/tp1", nic="mlx5_2", addr=0x7F0000000000, length=1 << 20,
                    rkey=0x1A2B, transport="rdma")


@pytest.mark.pyverbs
def test_status_table_matches_the_installed_pyverbs():
    import pyverbs.cq as cq
    import pyverbs.enums as e

    for status, (name, text) in WC_STATUS.items():
        assert getattr(e, name) == status
        assert cq.cqe_status_to_str(status) == text
    assert wc_status_str(99) == cq.cqe_status_to_str(99) == "Unknown CQE status"


@pytest.mark.parametrize(
    ("status", "cls", "text"),
    [
        (10, RemoteAccessError, "remote access error"),
        (9, RemoteAccessError, "remote invalidate request error"),
        (12, PeerUnreachableError, "retry exceeded error"),
        (13, PeerUnreachableError, "RNR retry exceeded"),
        (20, PeerUnreachableError, "response timeout error"),
        (5, TransportError, "WR flush error"),
        (4, TransportError, "local protection error"),
        (21, TransportError, "general error"),
        (77, TransportError, "Unknown CQE status"),
    ],
)
def test_status_maps_to_the_exception_class(status, cls, text):
    exc = completion_error(status, peer="engine0/tp1", region=REGION, offset=4096,
                           nbytes=65536, vendor_err=0x81)
    assert type(exc) is cls
    msg = str(exc)
    assert "peer 'engine0/tp1'" in msg
    assert REGION.describe() in msg
    assert text in msg
    assert wc_status_name(status) in msg
    assert "65536 B at offset 4096" in msg and "vendor_err=0x81" in msg


def test_hints_say_what_to_look_at():
    rkey = completion_error(10, peer="p", region=REGION, offset=0, nbytes=1)
    assert "wrong rkey" in str(rkey) and "deregistered" in str(rkey)
    gone = completion_error(12, peer="p", region=REGION, offset=0, nbytes=1)
    assert "process dead" in str(gone)
    flushed = completion_error(5, peer="p", region=REGION, offset=0, nbytes=1)
    assert "earlier work request" in str(flushed)


def test_success_is_not_an_error():
    with pytest.raises(ValueError, match="successful"):
        completion_error(0, peer="p", region=REGION, offset=0, nbytes=1)
