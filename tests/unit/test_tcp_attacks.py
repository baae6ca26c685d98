"""The ``tcp`` transport against an outsider, on 127.0.0.1 only.

One target NIC holds regions A and B; the plan gave writer ``trainer0/w0`` region A
and writer ``trainer1/w1`` region B. Every attack below fails with nothing written
(the target's bytes are compared with what they were) and is counted and logged
on the target: connecting without the key (a raw socket, and a separate plain
Python process), a wrong key, a stalled handshake, a flood of idle connections
(the planned writer still connects), a replayed, tampered or oversized frame,
a write into the other writer's region, with a wrong rkey, out of bounds or
outside the update window, and reads. Also: the listener binds only the
advertised address, and the contract's disconnect and transient classes.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import weight_transfer.transport.tcp.client as tcp_client
from weight_transfer.transport import make_transport
from weight_transfer.transport.base import PeerUnreachableError, RemoteAccessError
from weight_transfer.transport.tcp.client import Channel, LinkParams, sendmsg_all
from weight_transfer.transport.tcp.server import recv_exact
from weight_transfer.transport.tcp.transport import TcpLinkError
from weight_transfer.transport.tcp.wire import (
    BAD_OP,
    OK,
    OP_READ,
    OP_WRITE,
    OUT_OF_BOUNDS,
    UNKNOWN_REGION,
    Header,
    identity,
    pack_hello,
)
from weight_transfer.types import PeerInfo

HOST = "127.0.0.1"
N = 4096


class Setup:
    """A target with regions A and B, two planned writers, their link keys."""

    def __init__(self, **options) -> None:
        opts = {"host": HOST, "handshake_timeout_s": 0.5, "max_pending": 8, **options}
        self.target = make_transport("tcp", owner="engine0/tp0", nic="t0", **opts)
        self.a, self.b = np.zeros(N, np.uint8), np.zeros(N, np.uint8)
        self.ra, self.rb = self.target.register(self.a), self.target.register(self.b)
        self.writers, self.infos = [], []
        for i, region in enumerate((self.ra, self.rb)):
            self.target.grant(f"trainer{i}", f"w{i}", [region.addr])
            self.infos.append(self.target.peer_info(f"trainer{i}", f"w{i}"))
            w = make_transport("tcp", owner=f"trainer{i}", nic=f"w{i}", **opts)
            w.connect(self.infos[i])
            self.writers.append(w)
        self.port = self.infos[0].endpoint["port"]
        self.target.open_window()

    def snapshot(self) -> tuple[bytes, bytes]:
        return self.a.tobytes(), self.b.tobytes()

    def params(self, i: int = 0, key: bytes | None = None) -> LinkParams:
        ep = self.infos[i].endpoint
        return LinkParams(host=HOST, port=self.port, key=key or bytes.fromhex(ep["key"]),
                          writer_id=identity(f"trainer{i}", f"w{i}"),
                          target_id=identity("engine0/tp0", "t0"), encrypt=ep["encrypt"],
                          codec=ep["compression"], chunk_bytes=ep["chunk_bytes"],
                          connect_timeout_s=5.0)

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.target.close()


@pytest.fixture
def s():
    setup = Setup()
    yield setup
    setup.close()


def _write(nic, data, region, offset=0):
    asyncio.run(nic.write(data, region, offset))


def _fill(n=64, value=7):
    return np.full(n, value, np.uint8)


def _wait_closed(sock: socket.socket) -> bytes:
    """What the target sends before it closes the connection (b"": nothing)."""
    sock.settimeout(30)
    out = b""
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except ConnectionResetError:  # closed with our bytes unread
        pass
    return out


def _counted(read, n: int) -> bool:
    """Whether ``read()`` reaches ``n`` (the target counts on its own thread)."""
    deadline = time.monotonic() + 30
    while read() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return read() == n


def _hello(s: Setup, who=("trainer0", "w0")) -> socket.socket:
    sock = socket.create_connection((HOST, s.port))
    sock.sendall(pack_hello(0, 0, os.urandom(32), identity(*who)))
    return sock


# --------------------------------------------------------------------------- connections


def test_a_planned_write_lands(s):
    _write(s.writers[0], _fill(), s.ra, 8)
    assert (s.a[8:72] == 7).all() and s.a[:8].sum() == 0 and s.b.sum() == 0
    assert s.target.refused_writes == s.target.refused_connections == 0


def test_connecting_without_the_key_is_refused(s):
    before = s.snapshot()
    sock = _hello(s)  # claims to be the planned writer, holds no key
    recv_exact(sock, 64)  # the server's nonce and proof
    sock.sendall(os.urandom(32))  # a guessed proof
    assert _wait_closed(sock) == b""  # no ACCEPT: closed
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 64):
        junk_sock = socket.create_connection((HOST, s.port))
        junk_sock.sendall(junk)
        assert _wait_closed(junk_sock) == b""
    unknown = _hello(s, ("trainer9", "w9"))  # a writer the plan does not name
    recv_exact(unknown, 64)  # challenged like any name (tests/unit/test_tcp_oracle.py)
    unknown.sendall(os.urandom(32))
    assert _wait_closed(unknown) == b""
    assert s.snapshot() == before
    assert s.target.refused_connections == 4
    reasons = [r.reason for r in s.target.refusals()]
    assert any("failed the challenge" in r for r in reasons)
    assert any("not a writer the plan gave a key for" in r for r in reasons)


def test_a_wrong_key_fails_the_handshake(s):
    before = s.snapshot()
    bad = PeerInfo(owner="engine0/tp0", nic="t0", transport="tcp",
                   endpoint={**s.infos[0].endpoint, "key": os.urandom(32).hex()})
    with pytest.raises(PeerUnreachableError, match="did not prove the link key"):
        make_transport("tcp", owner="trainer0", nic="w0", host=HOST).connect(bad)
    assert s.snapshot() == before
    assert _counted(lambda: s.target.refused_connections, 1)


def test_an_outsider_process_without_the_key_writes_nothing(s):
    before = s.snapshot()
    script = textwrap.dedent(f"""
        import os, socket, struct
        sock = socket.create_connection(("{HOST}", {s.port}))
        wid = b"trainer0\\0w0"
        sock.sendall(b"WTT1" + bytes([1, 0, 0]) + struct.pack("<H", len(wid))
                     + os.urandom(32) + wid)
        sock.recv(64)
        sock.sendall(os.urandom(32))
        frame = struct.pack("<I", 64) + os.urandom(64) + bytes(64)  # a guessed frame
        try:
            sock.sendall(frame)
            print("reply", sock.recv(100))
        except OSError as exc:
            print("error", exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(("reply b''", "error")), out.stdout
    assert s.snapshot() == before and s.target.refused_connections == 1


def test_a_stalled_handshake_is_dropped(s):
    sock = socket.create_connection((HOST, s.port))
    sock.sendall(b"WTT1")  # and nothing more
    assert _wait_closed(sock) == b""
    assert s.target.refusals()[-1].reason == "handshake timed out"


def test_idle_connections_do_not_keep_a_planned_writer_out(s):
    before = s.snapshot()
    idle = [socket.create_connection((HOST, s.port)) for _ in range(3 * 8)]
    try:
        w = make_transport("tcp", owner="trainer0", nic="w0", host=HOST)
        w.connect(s.infos[0])  # with 24 idle connections open (8 may wait at once)
        _write(w, _fill(value=9), s.ra)
        w.close()
        assert (s.a[:64] == 9).all() and s.snapshot()[1] == before[1]
    finally:
        for sock in idle:
            sock.close()
    assert s.target.refused_connections >= 16  # pushed out or timed out, each counted


# --------------------------------------------------------------------------- frames


def test_replayed_and_tampered_frames_end_the_session_with_nothing_written(s, monkeypatch):
    frames = []

    def capture(sock, parts):  # the bytes a writer put on the wire, as a sniffer sees them
        frames.append(b"".join(bytes(p) for p in parts))
        sendmsg_all(sock, parts)

    monkeypatch.setattr(tcp_client, "sendmsg_all", capture)
    for attack in ("replay", "tamper", "oversize"):
        ch = Channel(s.params(0))
        frames.clear()
        assert ch.send(addr=s.ra.addr, rkey=s.ra.rkey, offset=0,
                       data=memoryview(_fill(value=1).tobytes())).result(10) == OK
        s.a[:] = 0
        before, refused = s.snapshot(), s.target.refused_writes
        frame = bytearray(frames[0])
        if attack == "tamper":
            frame[-1] ^= 1
        elif attack == "oversize":
            frame[:4] = (1 << 30).to_bytes(4, "little")
        ch._sock.sendall(bytes(frame))
        assert _wait_closed(ch._sock) == b""  # no ack: the session is closed
        assert s.snapshot() == before and s.target.refused_writes == refused + 1
        ch.close()
    reasons = [r.reason for r in s.target.refusals()]
    assert sum("authentication failed" in r for r in reasons) == 2
    assert any("larger than" in r for r in reasons)


def test_a_write_into_the_other_writers_region_is_refused(s):
    before = s.snapshot()
    with pytest.raises(RemoteAccessError, match="did not give this writer"):
        _write(s.writers[0], _fill(), s.rb)  # trainer0 may write A only
    with pytest.raises(RemoteAccessError, match="did not give this writer"):
        _write(s.writers[1], _fill(), s.ra)
    assert s.snapshot() == before and s.target.refused_writes == 2


def test_wrong_rkey_out_of_bounds_and_reads_are_refused(s):
    before = s.snapshot()
    ch = Channel(s.params(0))
    data = memoryview(_fill().tobytes())
    assert ch.send(addr=s.ra.addr, rkey=s.ra.rkey ^ 1, offset=0, data=data).result(10) \
        == UNKNOWN_REGION
    assert ch.send(addr=s.ra.addr, rkey=s.ra.rkey, offset=N - 8, data=data).result(10) \
        == OUT_OF_BOUNDS
    assert ch.send(addr=s.ra.addr, rkey=s.ra.rkey, offset=0, data=data,
                   op=OP_READ).result(10) == BAD_OP  # there is no read: only a refusal
    ch._sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        ch._sock.recv(1)  # nothing but the three acks came back
    ch.close()
    assert s.snapshot() == before and s.target.refused_writes == 3


def test_writes_outside_the_update_window_are_refused(s):
    s.target.close_window()
    before = s.snapshot()
    with pytest.raises(RemoteAccessError, match="outside an update window"):
        _write(s.writers[0], _fill(), s.ra)
    assert s.snapshot() == before and s.target.refused_writes == 1
    s.target.open_window()
    _write(s.writers[0], _fill(), s.ra)
    assert (s.a[:64] == 7).all()


def test_the_link_key_does_not_show_in_reprs(s):
    info = s.infos[0]
    key = info.endpoint["key"]
    assert key not in repr(info) and "<link key>" in repr(info)
    again = pickle.loads(pickle.dumps(info))
    assert again == info and bytes.fromhex(again.endpoint["key"]) == bytes.fromhex(key)


def test_a_new_setup_key_ends_the_old_one(s):
    old = s.infos[0]
    s.target.grant("trainer0", "w0", [s.ra.addr])
    fresh = s.target.peer_info("trainer0", "w0")
    assert fresh.endpoint["key"] != old.endpoint["key"]
    before = s.snapshot()
    with pytest.raises(PeerUnreachableError):
        make_transport("tcp", owner="trainer0", nic="w0", host=HOST).connect(old)
    with pytest.raises(TcpLinkError):  # its session under the old key was closed
        _write(s.writers[0], _fill(), s.ra)
    assert s.snapshot() == before


# --------------------------------------------------------------------------- listener, contract


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_the_listener_never_binds_a_wildcard_address(host):
    with pytest.raises(ValueError, match=r"wildcard|every interface"):
        make_transport("tcp", owner="e", nic="n", host=host)


def test_the_listener_binds_the_advertised_address_only(s):
    assert s.target._listener.gate.bound[0] == HOST
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.3", s.port), timeout=5)


def test_disconnect_refuses_later_writes_and_connect_heals(s):
    w = s.writers[0]
    assert w.disconnect("engine0/tp0", "t0") == 1
    with pytest.raises(PeerUnreachableError, match="disconnected"):
        _write(w, _fill(), s.ra)
    w.connect(s.infos[0])
    _write(w, _fill(value=3), s.ra)
    assert (s.a[:64] == 3).all()


def test_a_lost_connection_is_transient_and_a_refusal_is_not(s):
    w = s.writers[0]
    assert w.is_transient(TcpLinkError("lost"))
    assert not w.is_transient(RemoteAccessError("refused"))
    assert not w.is_transient(PeerUnreachableError("no ack"))


def test_encrypted_and_compressed_links_land_byte_exact():
    for options in ({"encrypt": True}, {"compression": "lz4"},
                    {"encrypt": True, "compression": "zstd", "chunk_bytes": 4096}):
        s = Setup(**options)
        try:
            data = np.tile(np.arange(256, dtype=np.uint8), N // 256)
            _write(s.writers[0], data, s.ra)
            assert (s.a == data).all() and s.b.sum() == 0
        finally:
            s.close()


def test_mismatched_link_options_are_refused_before_connecting(s):
    w = make_transport("tcp", owner="trainer0", nic="w0", host=HOST, encrypt=True)
    with pytest.raises(ValueError, match="encrypt"):
        w.connect(s.infos[0])


def test_header_fields_name_the_frame():
    assert Header(op=OP_WRITE, codec=0, seq=1, addr=1, rkey=1, offset=0, raw_len=1).op == 1


def test_a_deregistered_region_refuses_writes(s):
    s.target.deregister(s.ra)
    before = s.snapshot()
    with pytest.raises(RemoteAccessError, match="not registered there"):
        _write(s.writers[0], _fill(), s.ra)
    assert s.snapshot() == before and s.target.refused_writes == 1
    with pytest.raises(ValueError, match="not registered here"):
        s.target.deregister(s.ra)
