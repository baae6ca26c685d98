"""The transport protocol's helpers: what a write source or a registered buffer may be."""

from __future__ import annotations

import asyncio
import ctypes

import numpy as np
import pytest
import torch

from weight_transfer.transport import (
    BACKENDS,
    PeerUnreachableError,
    RemoteAccessError,
    Transport,
    TransportError,
    make_transport,
)
from weight_transfer.transport.base import check_write_range, source_buffer, target_buffer
from weight_transfer.types import RegionDesc


def raw(sb) -> bytes:
    return ctypes.string_at(sb.addr, sb.nbytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
def test_contiguous_tensor_is_sent_as_its_raw_bytes(dtype):
    t = torch.randn(7, 5).to(dtype)
    sb = source_buffer(t)
    assert sb.addr == t.data_ptr()
    assert sb.nbytes == t.numel() * t.element_size()
    assert raw(sb) == t.view(torch.uint8).numpy().tobytes()
    assert sb.keepalive is t


def test_non_contiguous_tensor_is_rejected_with_its_shape():
    t = torch.zeros(4, 6).t()
    with pytest.raises(ValueError, match=r"shape \(6, 4\) is not contiguous"):
        source_buffer(t)


def test_tensor_slice_that_is_contiguous_starts_at_its_own_address():
    t = torch.arange(100, dtype=torch.int32)
    part = t[10:20]
    sb = source_buffer(part)
    assert sb.addr == t.data_ptr() + 40 and sb.nbytes == 40
    assert raw(sb) == part.numpy().tobytes()


def test_numpy_arrays():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    sb = source_buffer(a)
    assert sb.addr == a.ctypes.data and sb.nbytes == 48 and raw(sb) == a.tobytes()
    with pytest.raises(ValueError, match="not C-contiguous"):
        source_buffer(a[:, ::2])


def test_buffers_writable_and_read_only():
    ba = bytearray(b"hello world")
    sb = source_buffer(ba)
    ba[0:5] = b"HELLO"  # no copy: the address is the bytearray's own memory
    assert raw(sb) == b"HELLO world"
    ro = source_buffer(b"read-only")  # copied once: ctypes cannot address read-only memory
    assert raw(ro) == b"read-only"
    assert source_buffer(b"").nbytes == 0
    with pytest.raises(ValueError, match="not contiguous"):
        source_buffer(memoryview(bytearray(16))[::2])


def test_explicit_address_ranges():
    buf = ctypes.create_string_buffer(b"abcdef", 6)
    sb = source_buffer((ctypes.addressof(buf), 6))
    assert raw(sb) == b"abcdef" and sb.keepalive is None
    with pytest.raises(ValueError, match="bad source byte range"):
        source_buffer((0, 6))
    with pytest.raises(ValueError, match="bad source byte range"):
        source_buffer((ctypes.addressof(buf), -1))


@pytest.mark.parametrize("bad", [3, 2.5, "text", object(), (1, 2, 3)])
def test_unsupported_sources_name_their_type(bad):
    with pytest.raises(ValueError, match=f"cannot write from {type(bad).__name__}"):
        source_buffer(bad)


def test_target_buffer_must_be_writable_and_non_empty():
    assert target_buffer(bytearray(8)).nbytes == 8
    ro = np.zeros(8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only array"):
        target_buffer(ro)
    with pytest.raises(ValueError, match="read-only memory"):
        target_buffer(b"12345678")
    with pytest.raises(ValueError, match="empty buffer"):
        target_buffer(bytearray())


REGION = RegionDesc(owner="eng0", nic="nic1", addr=0x10000, length=100, rkey=0xABC)


@pytest.mark.parametrize("offset,n", [(0, 100), (99, 1), (100, 0), (0, 0), (37, 63)])
def test_write_range_inside(offset, n):
    check_write_range(REGION, offset, n)


@pytest.mark.parametrize("offset,n", [(-1, 1), (0, 101), (100, 1), (99, 2), (2**64, 1)])
def test_write_range_outside_names_the_write_and_the_region(offset, n):
    with pytest.raises(RemoteAccessError) as err:
        check_write_range(REGION, offset, n)
    msg = str(err.value)
    assert f"write of {n} B at offset {offset} is outside" in msg
    assert REGION.describe() in msg  # the owner, NIC, address, length and rkey of the target
    for field in ("owner=eng0", "nic=nic1", "addr=0x10000", "length=100", "rkey=0xabc"):
        assert field in msg, field


def test_error_classes_are_runtime_errors_callers_can_tell_apart():
    # Callers catch TransportError (or RuntimeError: a failed peer or device) and
    # tell a refused write from a dead peer by class.
    for cls in (RemoteAccessError, PeerUnreachableError):
        assert issubclass(cls, TransportError) and issubclass(cls, RuntimeError)
    assert not issubclass(RemoteAccessError, PeerUnreachableError)
    assert not issubclass(PeerUnreachableError, RemoteAccessError)
    assert not issubclass(TransportError, ValueError)  # bad input stays a ValueError


def test_write_outside_the_region_is_refused_before_any_byte_moves(make_simnic):
    target = make_simnic(owner="eng0", nic="t0")
    writer = make_simnic(owner="trainer0", nic="w0")
    buf = np.full(100, 0x5C, np.uint8)
    desc = target.register(buf)
    writer.connect(target.peer_info("trainer0"))
    with pytest.raises(RemoteAccessError) as err:
        asyncio.run(writer.write(np.zeros(8, np.uint8), desc, 96))
    assert "write of 8 B at offset 96 is outside" in str(err.value)
    assert desc.describe() in str(err.value)
    assert (buf == 0x5C).all() and writer.writes == 0
    asyncio.run(writer.write(np.zeros(4, np.uint8), desc, 96))  # the link is still usable
    assert not buf[96:].any() and (buf[:96] == 0x5C).all()


def test_make_transport_knows_its_backends():
    with pytest.raises(ValueError, match=r"unknown transport 'ib'.*mooncake.*rdma.*simnic"):
        make_transport("ib", owner="x")
    assert set(BACKENDS) == {"simnic", "rdma", "mooncake", "tcp"}
    nic = make_transport("simnic", owner="x", nic="n3")
    try:
        assert isinstance(nic, Transport)
        assert (nic.kind, nic.owner, nic.nic) == ("simnic", "x", "n3")
    finally:
        nic.close()
