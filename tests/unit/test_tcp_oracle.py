"""The ``tcp`` listener is no identity oracle: an outsider on 127.0.0.1 cannot tell a
writer name the plan gave a key from any other name.

The outsider speaks raw sockets and holds no key. It says hello as a planned writer
(then sends a guessed proof, like a wrong key), as a name the plan does not know,
and as a planned writer asking for another mode; each gets a challenge of the same
size, answers with 32 bytes, and sees the same thing: no ACCEPT, an orderly close
after its proof. Nothing is written; each refusal is counted, and only the target's own
log names the real reason (each failed the challenge: none was closed early or timed
out). A writer transport that holds a wrong key and one whose name the plan does not
know fail with the same error. No time is asserted (a loaded machine stretches any):
the bytes and the target's reasons say that every case took the same path.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from weight_transfer.transport import make_transport
from weight_transfer.transport.base import PeerUnreachableError
from weight_transfer.transport.tcp.wire import MODE_ENCRYPT, MODE_PLAIN, identity, pack_hello
from weight_transfer.types import PeerInfo

HOST = "127.0.0.1"
TIMEOUT_S = 30.0  # the target's handshake_timeout_s: never what ends a case here
CHALLENGE = 64
TRIES = 8


@pytest.fixture
def target():
    t = make_transport("tcp", owner="engine0/tp0", nic="t0", host=HOST,
                       handshake_timeout_s=TIMEOUT_S)
    mem = np.zeros(4096, np.uint8)
    region = t.register(mem)
    t.grant("trainer0", "w0", [region.addr])
    info = t.peer_info("trainer0", "w0")
    t.open_window()
    yield t, mem, info
    t.close()


def _outsider(port: int, name: tuple[str, str], mode: int) -> tuple[list[int], str, float]:
    """Hello as ``name``, read what comes, send a guessed proof, read to the end:
    ``(lengths read before and after the proof, how it ended, seconds to the end)``."""
    sock = socket.create_connection((HOST, port), timeout=10)
    try:
        sock.sendall(pack_hello(mode, 0, os.urandom(32), identity(*name)))
        challenge = b""
        while len(challenge) < CHALLENGE and (chunk := sock.recv(CHALLENGE - len(challenge))):
            challenge += chunk  # the challenge, however late it comes
        sock.settimeout(0.1)
        try:  # anything more the target sends before it waits for a proof
            while chunk := sock.recv(4096):
                challenge += chunk
        except TimeoutError:
            pass
        sock.settimeout(10)
        sock.sendall(os.urandom(32))
        start, after, end = time.monotonic(), b"", "eof"
        try:
            while chunk := sock.recv(4096):
                after += chunk
        except ConnectionResetError:
            end = "reset"
        return [len(challenge), len(after)], end, time.monotonic() - start
    finally:
        sock.close()


def test_an_unknown_name_and_a_wrong_key_look_the_same_on_the_wire(target):
    t, mem, info = target
    port = info.endpoint["port"]
    cases = {"planned writer, wrong key": (("trainer0", "w0"), MODE_PLAIN),
             "unknown name": (("trainer9", "w9"), MODE_PLAIN),
             "planned writer, another mode": (("trainer0", "w0"), MODE_ENCRYPT)}
    seen = {case: [_outsider(port, *how) for _ in range(TRIES)] for case, how in cases.items()}
    for case, runs in seen.items():
        assert {(tuple(lengths), end) for lengths, end, _ in runs} == {((CHALLENGE, 0), "eof")}, (
            case, runs)
    assert not mem.any()
    deadline = time.monotonic() + 10
    while t.refused_connections < 3 * TRIES and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.refused_connections == 3 * TRIES
    reasons = [r.reason for r in t.refusals()]  # the target's own log names each
    assert all("failed the challenge" in r for r in reasons)
    assert sum("not a writer the plan gave a key for" in r for r in reasons) == TRIES
    assert sum("asked for mode" in r for r in reasons) == TRIES


def test_a_writer_cannot_tell_a_wrong_key_from_a_name_without_one(target):
    _, mem, info = target
    wrong_key = PeerInfo(owner="engine0/tp0", nic="t0", transport="tcp",
                         endpoint={**info.endpoint, "key": os.urandom(32).hex()})
    errors = []
    for owner, peer in (("trainer0", wrong_key), ("trainer9", info)):  # trainer9: no grant
        w = make_transport("tcp", owner=owner, nic="w0", host=HOST)
        try:
            with pytest.raises(PeerUnreachableError) as caught:
                w.connect(peer)
        finally:
            w.close()
        errors.append(str(caught.value).replace(owner, "WRITER"))
    assert errors[0] == errors[1] and "did not prove the link key" in errors[0]
    assert not mem.any()
