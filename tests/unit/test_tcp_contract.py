"""The ``tcp`` transport under the transport contract: chosen by name with its options
validated by its own model, a plan's updates land byte-exact through it (plain,
encrypted and compressed links), and it reaches other hosts only when each actor
advertises its own address."""

from __future__ import annotations

import pytest
from test_staging import Replay

from weight_transfer.transport import parse_transport, transport_class
from weight_transfer.transport.handshake import HostId, reaches
from weight_transfer.transport.tcp.transport import TcpOptions, TcpTransport


def test_tcp_is_registered_with_its_options_model():
    assert transport_class("tcp") is TcpTransport and TcpTransport.Options is TcpOptions
    spec = parse_transport("tcp", {"encrypt": True, "compression": "zstd"}, where="test")
    assert spec.kwargs(address="10.0.0.5")["host"] == "10.0.0.5"
    for bad, words in (({"encrypt": "yes"}, "encrypt"), ({"compression": "gzip"}, "compression"),
                       ({"chunk_bytes": 10}, "chunk_bytes"), ({"secret": "x"}, "secret")):
        with pytest.raises(ValueError, match=words):
            parse_transport("tcp", bad, where="TransferConfig")


def test_tcp_reaches_other_hosts_only_with_each_actors_address():
    a, b = HostId(hostname="a", address="10.0.0.1"), HostId(hostname="b", address="10.0.0.2")
    assert reaches(parse_transport("tcp", {}, where="t"), a, b)
    assert not reaches(parse_transport("tcp", {"host": "10.0.0.1"}, where="t"), a, b)


@pytest.mark.parametrize("options", [{}, {"encrypt": True, "chunk_bytes": 1 << 16},
                                     {"compression": "lz4"}])
def test_plan_updates_write_through_tcp(options):
    spec = parse_transport("tcp", {"host": "127.0.0.1", **options}, where="test")
    target, writer = spec.open(owner="engines", nic="t"), spec.open(owner="trainers", nic="w")
    try:
        r = Replay(target, writer)
        target.grant("trainers", "w", [e.tensors[0].region.addr for e in r.engines])
        writer.connect(target.peer_info("trainers", "w"))
        target.open_window()
        transfers = r.transfers()
        for version in (1, 2):
            reports = r.update(transfers, version)
            assert sum(rep.bytes_written for rep in reports) == r.plan.bytes_total
            r.check_bytes()  # every engine byte equals the reference layout of the weights
        assert writer.bytes_written == 2 * r.plan.bytes_total
        assert target.refused_writes == target.refused_connections == 0
        for t in transfers:
            t.close()
    finally:
        writer.close()
        target.close()
