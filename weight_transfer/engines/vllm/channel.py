"""Requests to, and replies from, our backend in the workers of a vLLM on another host.

vLLM's ``init_weight_transfer_engine`` (offline, ``AsyncLLM`` or the HTTP route
``POST /init_weight_transfer_engine``) carries a dict in and returns nothing.
On the same host the request and the replies travel through a private
directory (:mod:`.mailbox`). For a server on another host this module carries
them on the network, authenticated with a key both sides hold (the server's
processes read it from ``WT_VLLM_KEY``, 64 hex digits)::

    channel = ReplyChannel("10.0.0.5", key)       # listens on that address only
    info = channel.post("setup", SetupRequest(...), rank=-1)   # the init_info dict
    POST /init_weight_transfer_engine {"init_info": info}       # returns once workers ran it
    replies = channel.replies(info, ranks=range(tp))

1. The request is pickled into ``info["payload"]`` (base64) and signed:
   ``info["mac"]`` is HMAC-SHA256 under the key over the session, sequence
   number, operation, rank, reply address and payload. A worker unpickles
   nothing whose MAC it cannot verify, and refuses a sequence number it has
   seen before in the session (a replayed request) and a reply address other
   than the one the session's first verified request registered. A request it
   refuses gets no reply at all (:mod:`.inbox`): no connection, nothing signed.
2. Each worker that acts on a verified request connects to ``info["reply"]`` (the
   controller's listener; it binds one address, never a wildcard) and sends one frame:
   ``header length | header (JSON: session, seq, rank) | payload length |
   payload (pickle) | HMAC`` (another label). The listener unpickles only
   frames whose MAC verifies and whose session is its own.

The key authenticates both directions; it does not encrypt (the payloads are
connection metadata: NIC addresses, region keys of the transports, which are
themselves authenticated where the transport is ``tcp``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import time
from typing import Any

from weight_transfer.engines.vllm.mailbox import Failure
from weight_transfer.sync.listen import check_listen_address

log = logging.getLogger(__name__)

KEY_ENV = "WT_VLLM_KEY"
KEY_BYTES = 32
MAX_HEADER = 4096
MAX_PAYLOAD = 1 << 30
_LEN = struct.Struct("!I")
_PAYLOAD_LEN = struct.Struct("!Q")
_REQ, _REP = b"wt-vllm-request", b"wt-vllm-reply"


def new_key() -> str:
    """A fresh key as hex (give it to the server as ``WT_VLLM_KEY``)."""
    return secrets.token_hex(KEY_BYTES)


def parse_key(text: str | bytes, *, where: str = KEY_ENV) -> bytes:
    """The key from its hex form; ValueError naming ``where`` if it is not 32+ bytes."""
    try:
        key = bytes.fromhex(text.decode() if isinstance(text, bytes) else text)
    except ValueError:
        raise ValueError(f"{where}: not hex digits") from None
    if len(key) < KEY_BYTES:
        raise ValueError(f"{where}: {len(key)} bytes, need at least {KEY_BYTES} "
                         f"({2 * KEY_BYTES} hex digits)")
    return key


def env_key() -> bytes:
    """The worker's key, from ``WT_VLLM_KEY``; ValueError naming the variable if unset."""
    text = os.environ.get(KEY_ENV)
    if not text:
        raise ValueError(f"{KEY_ENV} is not set in the vLLM server's environment: a request "
                         "from another host cannot be authenticated (start the server with "
                         f"{KEY_ENV}=<the controller's key>)")
    return parse_key(text)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(_PAYLOAD_LEN.pack(len(p)))
        h.update(p)
    return h.digest()


def _request_mac(key: bytes, info: dict[str, Any], payload: bytes) -> bytes:
    fields = (info["session"], str(info["seq"]), info["op"], str(info["rank"]), info["reply"])
    return _mac(key, _REQ, *(f.encode() for f in fields), payload)


# ---------------------------------------------------------------------- worker side

# session -> (last sequence number accepted, the reply address its first request named)
_seen: dict[str, tuple[int, str]] = {}
_seen_lock = threading.Lock()


class RequestRefused(ValueError):
    """A request the worker cannot verify; ``kind``: bad MAC, replayed or reply address."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):
        return (_refused, (str(self), self.kind))


def _refused(message: str, kind: str) -> RequestRefused:
    return RequestRefused(message, kind=kind)


def verify_request(info: Any, key: bytes) -> bytes:
    """Worker side: the pickled request ``info`` carries, once its MAC is verified, its
    sequence number is new for the session and its reply address is the session's (the one
    its first verified request named); RequestRefused otherwise."""
    what = f"request {info.op!r} #{info.seq}"
    try:
        fields = {k: getattr(info, k) for k in ("session", "seq", "op", "rank", "reply")}
        payload, mac = base64.b64decode(info.payload), bytes.fromhex(info.mac)
        good = hmac.compare_digest(_request_mac(key, fields, payload), mac)
    except (ValueError, TypeError, AttributeError):  # malformed fields: not ours either
        good = False
    if not good:
        raise RequestRefused(f"{what}: bad MAC (is {KEY_ENV} the controller's key?)",
                             kind="bad MAC")
    with _seen_lock:
        last, reply = _seen.get(info.session, (0, info.reply))
        if info.seq <= last:
            raise RequestRefused(f"{what}: replayed (session {info.session} is at #{last})",
                                 kind="replayed")
        if info.reply != reply:
            raise RequestRefused(f"{what}: reply address {info.reply} is not {reply}, the "
                                 f"one session {info.session} registered", kind="reply address")
        _seen[info.session] = (info.seq, reply)
    return payload


def load_request(payload: bytes) -> Any:
    """The request of a payload :func:`verify_request` returned (only such is unpickled)."""
    return pickle.loads(payload)


def open_request(info: Any, key: bytes) -> Any:
    """Worker side: the request ``info`` carries, verified (:func:`verify_request`);
    RequestRefused (a ValueError) otherwise, with nothing unpickled."""
    return load_request(verify_request(info, key))


def send_reply(info: Any, rank: int, value: Any, key: bytes, *, timeout_s: float = 60.0) -> None:
    """Worker side: send ``value`` (pickled, signed) to the controller's listener."""
    header = json.dumps({"session": info.session, "seq": info.seq, "rank": rank}).encode()
    payload = pickle.dumps(value)
    host, _, port = info.reply.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as s:
        s.sendall(b"".join([_LEN.pack(len(header)), header, _PAYLOAD_LEN.pack(len(payload)),
                            payload, _mac(key, _REP, header, payload)]))


# ---------------------------------------------------------------------- controller side


def _read(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"closed with {left} of {n} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class ReplyChannel:
    """The controller's end: signs requests, collects the workers' signed replies."""

    def __init__(self, host: str, key: bytes | str, *, timeout_s: float = 60.0) -> None:
        self.key = parse_key(key, where="key") if isinstance(key, str) else key
        self.host = check_listen_address(host, what="vLLM reply channel")
        self.session = secrets.token_hex(8)
        self.timeout_s = timeout_s
        self._seq = 0
        self._replies: dict[tuple[int, int], bytes] = {}
        self._cond = threading.Condition()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((self.host, 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="wt-vllm-replies", daemon=True).start()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def post(self, op: str, request: Any = None, *, rank: int = -1) -> dict[str, Any]:
        """The signed ``init_info`` dict carrying ``request``."""
        self._seq += 1
        payload = pickle.dumps(request)
        info = {"op": op, "seq": self._seq, "rank": rank, "session": self.session,
                "reply": self.address}
        info["payload"] = base64.b64encode(payload).decode()
        info["mac"] = _request_mac(self.key, info, payload).hex()
        return info

    def replies(self, info: dict[str, Any], ranks) -> list[Any]:
        """Each rank's reply to ``info`` (a worker's failure raised, as the mailbox does);
        TimeoutError naming the ranks that sent none."""
        want = [(info["seq"], r) for r in ranks]
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not all(k in self._replies for k in want):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for s, r in want if (s, r) not in self._replies]
                    raise TimeoutError(
                        f"vLLM worker ranks {missing} sent no reply to {info['op']!r} within "
                        f"{self.timeout_s:g} s (can the server reach {self.address}? does its "
                        f"{KEY_ENV} equal this key?)")
                self._cond.wait(left)
            raw = [self._replies.pop(k) for k in want]
        out = []
        for (_, r), payload in zip(want, raw, strict=True):
            value = pickle.loads(payload)  # its MAC verified on arrival
            if isinstance(value, Failure):
                raise value.exception(f"vLLM worker rank {r}, {info['op']}")
            out.append(value)
        return out

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._receive, args=(conn, peer), daemon=True).start()

    def _receive(self, conn: socket.socket, peer: Any) -> None:
        with conn:
            try:
                conn.settimeout(self.timeout_s)
                (n,) = _LEN.unpack(_read(conn, _LEN.size))
                if n > MAX_HEADER:
                    raise ValueError(f"header of {n} bytes")
                header = _read(conn, n)
                (m,) = _PAYLOAD_LEN.unpack(_read(conn, _PAYLOAD_LEN.size))
                if m > MAX_PAYLOAD:
                    raise ValueError(f"payload of {m} bytes")
                payload = _read(conn, m)
                mac = _read(conn, hashlib.sha256().digest_size)
                if not hmac.compare_digest(mac, _mac(self.key, _REP, header, payload)):
                    raise ValueError("bad MAC")
                head = json.loads(header)
                if head["session"] != self.session:
                    raise ValueError(f"session {head['session']!r} is not ours")
            except (OSError, ValueError, KeyError, ConnectionError) as exc:
                log.warning("vLLM reply channel %s: dropped a frame from %s: %s",
                            self.address, peer, exc)
                return
        with self._cond:
            self._replies[(int(head["seq"]), int(head["rank"]))] = payload
            self._cond.notify_all()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
