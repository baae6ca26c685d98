"""Signatures of the controller's requests to guarded routes: made (:func:`sign_headers`) and
checked (:func:`check_head` before the body is read, :func:`check_body` after), with the
nonces of a time window (:class:`Nonces`). Pure: no ASGI, no server."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Mapping

from weight_transfer.engines.vllm.channel import _mac

WINDOW_S = 60.0
MAX_BODY = 64 << 20
_HEAD, _FULL = b"wt-vllm-route-head", b"wt-vllm-route"


def _fields(method: str, target: str, stamp: str, nonce: str, length: int) -> list[bytes]:
    return [method.upper().encode(), target.encode(), stamp.encode(), nonce.encode(),
            str(length).encode()]


def sign_headers(key: bytes, method: str, target: str, body: bytes = b"", *,
                 now: float | None = None, nonce: str | None = None) -> dict[str, str]:
    """The headers that let a request ``method target`` (path and query, as sent) with
    ``body`` through the guard of a server holding ``key``."""
    stamp = f"{time.time() if now is None else now:.3f}"
    nonce = nonce or secrets.token_hex(16)
    fields = _fields(method, target, stamp, nonce, len(body))
    return {"x-wt-time": stamp, "x-wt-nonce": nonce,
            "x-wt-head": _mac(key, _HEAD, *fields).hex(),
            "x-wt-mac": _mac(key, _FULL, *fields, hashlib.sha256(body).digest()).hex()}


class Nonces:
    """Nonces of verified requests, each kept until its time leaves the window."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def seen(self, nonce: str) -> bool:
        with self._lock:
            return nonce in self._until

    def add(self, nonce: str, stamp: float, now: float) -> bool:
        """Record ``nonce``; False if it was already there (a replay)."""
        with self._lock:
            if len(self._until) > 1024:
                self._until = {n: t for n, t in self._until.items() if t > now}
            if nonce in self._until:
                return False
            self._until[nonce] = stamp + 2 * self.window_s
            return True


def check_head(key: bytes | None, method: str, target: str, headers: Mapping[str, str],
               length: int, nonces: Nonces, *, now: float) -> str | None:
    """Why the request's headers are refused before its body is read (None: read it)."""
    if key is None:
        return "no key"
    stamp, nonce = headers.get("x-wt-time"), headers.get("x-wt-nonce")
    head = headers.get("x-wt-head")
    if not (stamp and nonce and head and headers.get("x-wt-mac")):
        return "unsigned"
    try:
        t = float(stamp)
    except ValueError:
        return "bad time"
    if not abs(now - t) <= nonces.window_s:
        return "stale time"
    if length > MAX_BODY:
        return "body too large"
    want = _mac(key, _HEAD, *_fields(method, target, stamp, nonce, length))
    if not hmac.compare_digest(want.hex(), head):
        return "bad signature"
    if nonces.seen(nonce):
        return "replayed nonce"
    return None


def check_body(key: bytes, method: str, target: str, headers: Mapping[str, str], body: bytes,
               nonces: Nonces, *, now: float) -> str | None:
    """Why the request is refused once its body is read (None: it passes; its nonce is
    now spent)."""
    stamp, nonce = headers["x-wt-time"], headers["x-wt-nonce"]
    fields = _fields(method, target, stamp, nonce, len(body))
    want = _mac(key, _FULL, *fields, hashlib.sha256(body).digest())
    if not hmac.compare_digest(want.hex(), headers["x-wt-mac"]):
        return "bad signature"
    if not nonces.add(nonce, float(stamp), now):
        return "replayed nonce"
    return None
