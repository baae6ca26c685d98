"""The authenticated request/reply channel of the vLLM backend (a server on another host):
requests are signed and refused when tampered with, replayed or signed with another key;
replies arrive only when their MAC verifies; a worker's failure is raised on the
controller's side; a missing reply names the rank; nothing binds a wildcard."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import pytest

from weight_transfer.engines.vllm import channel
from weight_transfer.engines.vllm.mailbox import Failure, SetupRequest


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
def chan():
    c = channel.ReplyChannel("127.0.0.1", channel.new_key(), timeout_s=2)
    yield c
    c.close()


def test_a_signed_request_round_trips_and_the_reply_comes_back(chan):
    req = SetupRequest(replica="engine0", nics=(("inode0/nic0",),), transport=None)
    info = Info(**chan.post("setup", req, rank=-1))
    assert channel.open_request(info, chan.key) == req
    for rank in (0, 1):
        channel.send_reply(info, rank, {"rank": rank}, chan.key)
    assert chan.replies(vars(info), [0, 1]) == [{"rank": 0}, {"rank": 1}]


def test_tampered_replayed_or_foreign_requests_are_refused(chan):
    info = Info(**chan.post("stats", None, rank=0))
    with pytest.raises(ValueError, match="bad MAC"):
        channel.open_request(Info(**{**vars(info), "rank": 1}), chan.key)
    with pytest.raises(ValueError, match="bad MAC"):
        channel.open_request(info, channel.parse_key(channel.new_key()))
    channel.open_request(info, chan.key)
    with pytest.raises(ValueError, match="replayed"):
        channel.open_request(info, chan.key)


def test_a_reply_signed_with_another_key_is_dropped_and_the_wait_names_the_rank(chan):
    info = Info(**chan.post("stats", None, rank=0))
    channel.send_reply(info, 0, "forged", channel.parse_key(channel.new_key()))
    with pytest.raises(TimeoutError, match=r"ranks \[0\] sent no reply to 'stats'.*WT_VLLM_KEY"):
        chan.replies(vars(info), [0])


def test_a_workers_failure_is_raised_with_its_type(chan):
    info = Info(**chan.post("connect", [], rank=0))
    try:
        raise KeyError("inode9/nic0")
    except KeyError as exc:
        failure = Failure.of(exc)
    channel.send_reply(info, 0, failure, chan.key)
    with pytest.raises(KeyError, match="inode9/nic0"):
        chan.replies(vars(info), [0])


def test_garbage_on_the_reply_port_is_dropped(chan):
    with socket.create_connection(("127.0.0.1", chan.port)) as s:
        s.sendall(b"\xff\xff\xff\xff garbage")
    info = Info(**chan.post("stats", None, rank=0))
    channel.send_reply(info, 0, 7, chan.key)
    assert chan.replies(vars(info), [0]) == [7]


def test_keys_and_addresses_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="vLLM reply channel"):
        channel.ReplyChannel("0.0.0.0", channel.new_key())
    with pytest.raises(ValueError, match="key: 4 bytes, need at least 32"):
        channel.ReplyChannel("127.0.0.1", "00112233")
    monkeypatch.delenv(channel.KEY_ENV, raising=False)
    with pytest.raises(ValueError, match="WT_VLLM_KEY is not set"):
        channel.env_key()
    monkeypatch.setenv(channel.KEY_ENV, "zz")
    with pytest.raises(ValueError, match="WT_VLLM_KEY: not hex"):
        channel.env_key()


def test_the_server_command_names_our_backend_by_its_one_config_value():
    from weight_transfer.engines.vllm.server import cli_flags, serve_command

    cmd = serve_command("/m", host="127.0.0.1", port=8000, engine_args={"dtype": "float32"})
    i = cmd.index("--weight-transfer-config")
    assert cmd[i + 1] == '{"backend": "wt_onesided"}'
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--enable-scale-out" in cmd
    assert cmd[cmd.index("--middleware") + 1] == "weight_transfer.engines.vllm.guard.RouteGuard"
    assert cli_flags({"max_model_len": 256, "enforce_eager": True, "x": False}) == [
        "--max-model-len", "256", "--enforce-eager"]
