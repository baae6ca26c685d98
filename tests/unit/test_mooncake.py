"""Pure parts of the Mooncake transport: chunking, deadlines, session ids, the
call thread, argument checks, and the message when the package is missing."""

import sys
import threading

import pytest

from weight_transfer.transport import make_transport
from weight_transfer.transport.mooncake.transport import (
    CallThread,
    MooncakeTransport,
    chunk_deadline_s,
    load_engine_class,
    parse_session_id,
    split_chunks,
)

MiB = 1 << 20


@pytest.mark.parametrize(
    ("nbytes", "chunk", "expected"),
    [
        (0, 4, []),
        (1, 4, [(0, 1)]),
        (4, 4, [(0, 4)]),
        (9, 4, [(0, 4), (4, 4), (8, 1)]),
        (256 * MiB, 64 * MiB, [(i * 64 * MiB, 64 * MiB) for i in range(4)]),
    ],
)
def test_split_chunks_cover_the_range_exactly(nbytes, chunk, expected):
    pieces = split_chunks(nbytes, chunk)
    assert pieces == expected
    assert sum(n for _, n in pieces) == nbytes


def test_split_chunks_rejects_nonpositive_chunk():
    with pytest.raises(ValueError, match="chunk_bytes must be positive, got 0"):
        split_chunks(10, 0)


def test_chunk_deadline_grows_with_bytes_at_the_slowest_rate():
    assert chunk_deadline_s(0, 5.0, 0.1) == 5.0
    assert chunk_deadline_s(10**9, 5.0, 0.1) == pytest.approx(15.0)


@pytest.mark.parametrize("good", ["127.0.0.1:15000", "node-3.cluster:1"])
def test_session_id_accepts_host_port(good):
    assert parse_session_id(good, "here") == good


@pytest.mark.parametrize("bad", [None, 15000, "", "127.0.0.1", ":15000", "host:", "host:port"])
def test_session_id_rejects_other_shapes_naming_the_caller(bad):
    with pytest.raises(ValueError, match=r"connect to e0/mc0: session_id must be 'host:port'"):
        parse_session_id(bad, "connect to e0/mc0")


def test_call_thread_runs_in_order_and_returns_results_and_errors():
    calls = CallThread("test-calls")
    seen: list[int] = []
    futs = [calls.call(seen.append, i) for i in range(5)]
    boom = calls.call(int, "not a number")
    last = calls.call(threading.current_thread)
    assert [f.result(timeout=10) for f in futs] == [None] * 5
    assert seen == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="invalid literal"):
        boom.result(timeout=10)
    assert last.result(timeout=10).name == "test-calls"
    assert last.result(timeout=10).daemon
    assert not calls.busy
    calls.stop()


def test_call_thread_skips_a_call_cancelled_before_it_ran():
    calls = CallThread("test-cancel")
    gate = threading.Event()
    blocker = calls.call(gate.wait, 10)
    ran: list[str] = []
    skipped = calls.call(ran.append, "should not run")
    assert skipped.cancel()
    after = calls.call(ran.append, "runs")
    assert calls.busy
    gate.set()
    assert blocker.result(timeout=10) is True
    after.result(timeout=10)
    assert ran == ["runs"]
    calls.stop()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"owner": ""}, "owner, nic, protocol, hostname must be non-empty"),
        ({"owner": "t0", "max_inflight": 0}, r"mooncake t0/mc0: max_inflight=0"),
        ({"owner": "t0", "chunk_bytes": -1}, r"chunk_bytes=-1"),
        ({"owner": "t0", "timeout_s": 0}, r"timeout_s=0"),
    ],
)
def test_constructor_rejects_bad_arguments_before_starting_an_engine(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MooncakeTransport(**kwargs)


def test_missing_package_says_to_install_the_mooncake_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # makes the import fail
    with pytest.raises(RuntimeError, match=r"install the `mooncake` extra") as info:
        load_engine_class()
    assert "weight-transfer[mooncake]" in str(info.value)
    with pytest.raises(RuntimeError, match=r"Mooncake TransferEngine unavailable"):
        make_transport("mooncake", owner="t0", nic="mc0", protocol="tcp",
                       hostname="127.0.0.1", device_name="")
