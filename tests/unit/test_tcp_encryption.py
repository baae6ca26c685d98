"""The ``tcp`` transport encrypts across hosts unless told otherwise.

The rule (``weight_transfer.transport.tcp.encryption``) as a table: unset, a
connection whose two ends have one address (the same host, over loopback) is
authenticated-only, any other is encrypted; ``true`` and ``false`` are honoured.
Then an on-path reader: a proxy on 127.0.0.3 between a writer at 127.0.0.1 and a
target at 127.0.0.2 (another host by that rule) forwards and records every byte.
Under the defaults it sees no byte of the weights, and the write lands; with an
explicit ``encrypt: false`` it reads them, and the writer warned once for that host
pair. Within one host the defaults stay authenticated-only. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading

import numpy as np
import pytest

from weight_transfer.transport import make_transport, parse_transport
from weight_transfer.transport.tcp import encryption
from weight_transfer.types import PeerInfo

N = 1 << 18


@pytest.mark.parametrize(("setting", "local", "peer", "encrypts"), [
    (None, "127.0.0.1", "127.0.0.1", False),  # one host, over loopback
    (None, "10.0.0.2", "10.0.0.2", False),  # one node, its own address
    (None, "::1", "::1", False),
    (None, "::ffff:10.0.0.2", "10.0.0.2", False),  # one address, two spellings
    (None, "fe80::1%eth0", "fe80::1", False),
    (None, "10.0.0.1", "10.0.0.2", True),  # across hosts
    (None, "127.0.0.1", "127.0.0.2", True),  # another address counts as another host
    (None, "10.0.0.1", "fd00::2", True),
    (True, "127.0.0.1", "127.0.0.1", True),
    (False, "10.0.0.1", "10.0.0.2", False),  # the user's explicit choice
])
def test_the_default_encrypts_across_hosts_only(setting, local, peer, encrypts):
    assert encryption.link_encrypts(setting, local, peer) is encrypts
    assert encryption.link_encrypts(setting, peer, local) is encrypts  # both ends agree


def test_the_option_is_unset_by_default_and_takes_true_false_or_null():
    assert parse_transport("tcp", {}, where="test").options.encrypt is None
    for value in (True, False, None):
        assert parse_transport("tcp", {"encrypt": value}, where="t").options.encrypt is value
    with pytest.raises(ValueError, match="encrypt"):
        parse_transport("tcp", {"encrypt": "no"}, where="test")


class Proxy:
    """An on-path reader: forwards 127.0.0.3:port <-> target and records both directions."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.seen = target, bytearray()
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.3", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                with self._lock:
                    self.seen += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._sock.close()


def _through_the_proxy(weights: np.ndarray, **options) -> tuple[bytes, np.ndarray, bool]:
    """A writer at 127.0.0.1 writes ``weights`` into a target at 127.0.0.2 through the
    proxy: ``(what the proxy saw, the target's memory, whether the writer encrypted)``."""
    opts = {"chunk_bytes": 1 << 16, **options}
    target = make_transport("tcp", owner="engine0/tp0", nic="t0", host="127.0.0.2", **opts)
    writer = make_transport("tcp", owner="trainer0", nic="w0", host="127.0.0.1", **opts)
    mem = np.zeros(N, np.uint8)
    proxy = None
    try:
        region = target.register(mem)
        target.grant("trainer0", "w0", [region.addr])
        info = target.peer_info("trainer0", "w0")
        proxy = Proxy(("127.0.0.2", info.endpoint["port"]))
        on_path = PeerInfo(owner=info.owner, nic=info.nic, transport=info.transport,
                           endpoint={**info.endpoint, "host": "127.0.0.3", "port": proxy.port})
        writer.connect(on_path)
        target.open_window()
        asyncio.run(writer.write(weights, region))
        encrypted = writer.encrypts_to("engine0/tp0", "t0")
        return bytes(proxy.seen), mem.copy(), encrypted
    finally:
        writer.close()
        target.close()
        if proxy is not None:
            proxy.close()


def _readable(weights: bytes, seen: bytes) -> int:
    """How many 32-byte samples of ``weights`` (one per 4 KiB) the reader saw."""
    return sum(weights[i:i + 32] in seen for i in range(0, len(weights), 4096))


def test_an_on_path_reader_sees_no_weight_bytes_under_the_defaults():
    weights = np.frombuffer(os.urandom(N), np.uint8)
    seen, landed, encrypted = _through_the_proxy(weights)
    assert encrypted and (landed == weights).all()
    assert len(seen) > N and _readable(weights.tobytes(), seen) == 0


def test_an_explicit_false_is_honoured_and_warned_once_per_host_pair(caplog):
    weights = np.frombuffer(os.urandom(N), np.uint8)
    with caplog.at_level(logging.WARNING, logger=encryption.__name__):
        seen, landed, encrypted = _through_the_proxy(weights, encrypt=False)
        _through_the_proxy(weights, encrypt=False)  # the same host pair: no second warning
    assert not encrypted and (landed == weights).all()
    assert _readable(weights.tobytes(), seen) == N // 4096  # the reader reads them all
    warned = [r.getMessage() for r in caplog.records if "in clear" in r.getMessage()]
    assert len(warned) == 1 and "127.0.0.1 to 127.0.0.3" in warned[0]


def test_within_one_host_the_default_stays_authenticated_only(caplog):
    target = make_transport("tcp", owner="engine0/tp0", nic="t0", host="127.0.0.1")
    writers = [make_transport("tcp", owner="trainer0", nic="w0", host="127.0.0.1",
                              encrypt=setting) for setting in (None, False)]
    try:
        mem = np.zeros(4096, np.uint8)
        region = target.register(mem)
        target.grant("trainer0", "w0", [region.addr])
        writer = writers[0]
        writer.connect(target.peer_info("trainer0", "w0"))
        assert writer.encrypts_to("engine0/tp0", "t0") is False
        target.open_window()
        asyncio.run(writer.write(np.full(64, 5, np.uint8), region))
        assert (mem[:64] == 5).all()
        with caplog.at_level(logging.WARNING, logger=encryption.__name__):
            encryption.warn_if_clear(False, "127.0.0.1", "127.0.0.1", label="t", target="x")
        assert caplog.records == []  # nothing leaves the host: nothing to warn about
    finally:
        for w in writers:
            w.close()
        target.close()
