"""A vLLM worker of our backend is no signing oracle: a request it cannot verify gets
nothing, anywhere.

The outsider holds no ``WT_VLLM_KEY``. It forges requests (signed with its own key,
or with garbage for a MAC) whose reply address is a socket it listens on at
127.0.0.1, replays a request the controller sent, and sends an unsigned request to a
worker that holds the key. The listening socket must receive no connection and no
frame, the operation must not run, each refusal is counted and only the first of its
kind is logged at WARNING. The key holder's requests still run and their replies
arrive; a session's replies go only to the address its first request registered.
Also through ``OneSidedBackend.init_transfer_engine`` itself (skipped without vLLM).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from weight_transfer.engines.vllm import channel, inbox
from weight_transfer.engines.vllm.mailbox import Mailbox

HOST = "127.0.0.1"


@dataclass
class Info:  # what the backend's OneSidedInitInfo carries
    op: str
    seq: int
    rank: int
    session: str
    reply: str
    payload: str
    mac: str
    mailbox: str = ""


@pytest.fixture
def chan(monkeypatch):
    c = channel.ReplyChannel(HOST, channel.new_key(), timeout_s=2)
    monkeypatch.setenv(channel.KEY_ENV, c.key.hex())  # the worker holds the controller's key
    yield c
    c.close()


@pytest.fixture
def outsider():
    """The outsider's own listener: where its forged requests ask for the reply."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen(8)
    sock.settimeout(0.5)
    yield sock, f"{HOST}:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture
def connects(monkeypatch):
    """Every connection the worker opens (the real one is still made)."""
    seen: list[tuple] = []
    real = socket.create_connection

    def record(address, *args, **kwargs):
        seen.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(channel.socket, "create_connection", record)
    return seen


def _nothing_arrives(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except TimeoutError:
        return True
    conn.close()
    return False


def _serve(info, ran: list) -> None:
    inbox.serve(info, rank=0, owner="engine0/tp0", run=lambda req: ran.append(req) or "ran")


def _forged(reply: str, *, session: str = "s0", seq: int = 1, op: str = "stats") -> list[Info]:
    mine = channel.ReplyChannel(HOST, channel.new_key())  # the outsider's own key
    try:
        mine.session = session
        signed = mine.post(op, None, rank=0)
    finally:
        mine.close()
    signed["reply"] = reply  # its MAC is now wrong twice over
    return [Info(**signed), Info(**{**signed, "mac": "00" * 32}),
            Info(**{**signed, "mac": "not hex"}), Info(**{**signed, "payload": "!!"})]


def test_a_forged_request_gets_no_connection_and_no_signed_frame(chan, outsider, connects,
                                                                 caplog):
    sock, address = outsider
    before, ran = inbox.refused_requests(), []
    with caplog.at_level(logging.DEBUG, logger=inbox.__name__):
        for info in _forged(address, session=chan.session) + _forged(address):
            _serve(info, ran)
    assert _nothing_arrives(sock) and connects == [] and ran == []
    assert inbox.refused_requests() == before + 8
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) <= 1  # once per kind and process (an earlier test may have warned)
    assert all("nothing sent" in r.getMessage() for r in caplog.records)


def test_a_replayed_request_gets_nothing_and_the_key_holder_is_served(chan, outsider,
                                                                      connects):
    sock, _ = outsider
    info, ran = Info(**chan.post("stats", None, rank=0)), []
    _serve(info, ran)
    assert ran == [None] and chan.replies(vars(info), [0]) == ["ran"]
    assert connects == [(HOST, chan.port)]
    before = inbox.refused_requests()
    _serve(info, ran)  # replayed by whoever saw it on the wire
    assert ran == [None] and connects == [(HOST, chan.port)] and _nothing_arrives(sock)
    assert inbox.refused_requests() == before + 1
    with pytest.raises(TimeoutError, match="sent no reply"):
        chan.replies(vars(info), [0])


def test_a_sessions_replies_go_only_to_the_address_its_first_request_registered(
        chan, outsider, connects):
    sock, address = outsider
    first, ran = Info(**chan.post("setup", None, rank=0)), []
    _serve(first, ran)
    assert chan.replies(vars(first), [0]) == ["ran"]
    moved = channel.ReplyChannel(HOST, chan.key)  # the key holder, another address
    try:
        moved.session, moved._seq = chan.session, chan._seq
        elsewhere = moved.post("stats", None, rank=0)
    finally:
        moved.close()
    before = inbox.refused_requests()
    _serve(Info(**{**elsewhere, "reply": address}), ran)  # forged: bad MAC
    _serve(Info(**elsewhere), ran)  # signed, but not the session's address
    assert ran == [None] and len(connects) == 1 and _nothing_arrives(sock)
    assert inbox.refused_requests() == before + 2
    with pytest.raises(channel.RequestRefused, match=r"is not .*, the one session") as caught:
        channel.verify_request(Info(**elsewhere), chan.key)
    assert caught.value.kind == "reply address"


def test_a_worker_without_the_key_sends_nothing(chan, connects, monkeypatch):
    info, ran = Info(**chan.post("stats", None, rank=0)), []
    monkeypatch.delenv(channel.KEY_ENV)
    before = inbox.refused_requests()
    _serve(info, ran)
    assert ran == [] and connects == [] and inbox.refused_requests() == before + 1


def test_an_unsigned_request_to_a_worker_holding_the_key_is_refused(chan, tmp_path):
    box, ran = Mailbox(tmp_path), []
    info = Info(session="", reply="", payload="", mac="", **box.post("stats", None, rank=0))
    before = inbox.refused_requests()
    with pytest.raises(ValueError, match="every request must be signed"):
        _serve(info, ran)
    assert ran == [] and list(tmp_path.glob("*.rep")) == []
    assert inbox.refused_requests() == before + 1


def test_the_same_host_mailbox_path_still_runs(tmp_path, monkeypatch):
    monkeypatch.delenv(channel.KEY_ENV, raising=False)
    box, ran = Mailbox(tmp_path), []
    info = Info(session="", reply="", payload="", mac="", **box.post("stats", 5, rank=0))
    _serve(info, ran)
    assert ran == [5] and box.replies(vars(info), [0]) == ["ran"]


def test_the_backend_itself_sends_nothing_for_a_forged_request(chan, outsider, connects):
    """Through ``OneSidedBackend.init_transfer_engine``, as vLLM calls it."""
    from actors.tools.testkit.vllm_oracle import vllm_missing

    if (why := vllm_missing()) is not None:
        pytest.skip(why)
    from weight_transfer.engines.vllm.backend import OneSidedBackend, OneSidedInitInfo

    sock, address = outsider
    worker = SimpleNamespace(shard=SimpleNamespace(tp_rank=0), owner="engine0/tp0",
                             mem=SimpleNamespace(stats=dict), finished=0)
    for forged in _forged(address):
        OneSidedBackend.init_transfer_engine(worker, OneSidedInitInfo(**vars(forged)))
    assert _nothing_arrives(sock) and connects == []
    info = Info(**chan.post("stats", None, rank=0))
    OneSidedBackend.init_transfer_engine(worker, OneSidedInitInfo(**vars(info)))
    (stats,) = chan.replies(vars(info), [0])
    assert stats["finished"] == 0 and stats["refused_requests"] >= 4
