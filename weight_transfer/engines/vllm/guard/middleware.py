"""vLLM's control routes callable only by the controller: an ASGI middleware for ``vllm serve``.

vLLM serves its RL and dev routes (``/pause``, ``/finish_weight_update``,
``/collective_rpc``, ...) to anyone who reaches the server; its ``--api-key``
covers only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``. The server loads
this guard with ``--middleware`` (vLLM 0.32 adds a class with
``app.add_middleware(cls)``, around the whole app)::

    WT_VLLM_KEY=<key> VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --middleware weight_transfer.engines.vllm.guard.RouteGuard ...

A request to a route in :data:`GUARDED` passes only if it carries
:func:`sign_headers`' headers under the server's ``WT_VLLM_KEY`` (the key of
the backend's channel, :mod:`.channel`):

1. ``x-wt-time`` (Unix seconds) within :data:`WINDOW_S` of the server's clock
   and ``x-wt-nonce`` not seen within the window (kept until it expires);
2. ``x-wt-head``: HMAC-SHA256 over method, path and query, time, nonce and body
   length, checked before the body is read (an outsider gets no body buffered);
3. ``x-wt-mac``: the same fields and the body's SHA-256, checked once it is read.

Anything else gets HTTP 403, ``{"error": "wt route guard: <reason>"}`` and the
header ``x-wt-guard: refused`` (how ``HttpLink.check_guard`` tells our guard from
anything else), is counted per reason (:data:`REFUSED`) and logged at most once
per reason per :data:`LOG_EVERY_S`. Every other route (generation, ``/health``,
``/v1/models``, ``/weight_info``, ``/is_paused``) passes untouched. A server
without ``WT_VLLM_KEY`` refuses every guarded route (reason ``no key``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from weight_transfer.engines.vllm.channel import KEY_ENV, _mac, parse_key

log = logging.getLogger(__name__)

IMPORT_PATH = "weight_transfer.engines.vllm.guard.RouteGuard"
WINDOW_S = 60.0
LOG_EVERY_S = 60.0
MAX_BODY = 64 << 20
GUARD_HEADER = "x-wt-guard"
_HEAD, _FULL = b"wt-vllm-route-head", b"wt-vllm-route"

# The routes of vLLM 0.32 that change weights or serving state, and what an outsider did
# with each (docs/security.md). Reads stay open: /weight_info, /is_paused, /get_world_size,
# /server_info, /health, /v1/models, generation. /v1/load_lora_adapter and
# /v1/unload_lora_adapter change the served weights too; they sit under /v1 (vLLM's
# --api-key) and are guarded here as well.
GUARDED: Mapping[str, str] = {
    "/pause": "pauses (or aborts) generation mid-update or at any time",
    "/resume": "resumes generation while an update is writing (the engine serves torn weights)",
    "/abort_requests": "aborts every request in flight",
    "/init_weight_transfer_engine": "runs our backend's operations (setup, close, stats)",
    "/shutdown_weight_transfer_engine": "shuts the weight-transfer engine down",
    "/start_weight_update": "opens the update window (tcp: writes accepted)",
    "/start_draft_weight_update": "opens the draft model's update window",
    "/update_weights": "loads weights",
    "/finish_weight_update": "ends an update mid-transfer (a torn replica)",
    "/update_weight_version": "relabels the served version",
    "/weight_checker": "resets weights (action reset); checksums every weight",
    "/collective_rpc": "calls any worker method",
    "/sleep": "offloads or drops the weights and KV cache",
    "/wake_up": "reloads weights and KV cache",
    "/release_kv_cache_memory": "frees the KV cache",
    "/reset_prefix_cache": "drops cached prefixes (and recomputes running requests)",
    "/reset_mm_cache": "drops the multimodal cache",
    "/reset_encoder_cache": "drops the encoder cache",
    "/start_profile": "starts the profiler (slows serving, writes traces)",
    "/stop_profile": "stops the profiler",
    "/scale_elastic_ep": "rescales the engine's expert parallelism",
    "/fault_tolerance/apply": "applies a fault-tolerance instruction",
    "/v1/load_lora_adapter": "loads a LoRA adapter into the served model",
    "/v1/unload_lora_adapter": "unloads a LoRA adapter",
}

REFUSED: dict[str, int] = {}  # reason -> requests refused, in this server process
_last_log: dict[str, tuple[float, int]] = {}
_lock = threading.Lock()


def route_of(path: str, root_path: str = "") -> str:
    """The route vLLM's router matches (as Starlette strips ``root_path``), without a
    trailing slash (a redirect would lead there)."""
    if root_path and path.startswith(root_path) and path[len(root_path):len(root_path) + 1] in (
            "/", ""):
        path = path[len(root_path):]
    return path.rstrip("/") or "/"


def is_guarded(path: str, root_path: str = "") -> bool:
    return route_of(path, root_path) in GUARDED


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


def count_refused(reason: str, what: str, *, now: float | None = None) -> None:
    """Count a refusal; log it unless this reason was logged within LOG_EVERY_S."""
    now = time.monotonic() if now is None else now
    with _lock:
        REFUSED[reason] = REFUSED.get(reason, 0) + 1
        last, count = _last_log.get(reason, (-LOG_EVERY_S - 1.0, 0))
        if now - last < LOG_EVERY_S:
            return
        _last_log[reason] = (now, REFUSED[reason])
    log.warning("vLLM route guard: refused %s: %s (%d refused for this reason, %d since the "
                "last report)", what, reason, REFUSED[reason], REFUSED[reason] - count)


def _server_key() -> bytes | None:
    text = os.environ.get(KEY_ENV)
    try:
        return parse_key(text) if text else None
    except ValueError as exc:
        log.error("vLLM route guard: %s; every guarded route is refused", exc)
        return None


class RouteGuard:
    """The ASGI middleware (see the module docstring); ``key`` defaults to the server's
    ``WT_VLLM_KEY``, ``clock`` to ``time.time``."""

    def __init__(self, app: Callable, key: bytes | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.app, self.clock = app, clock
        self.key = key if key is not None else _server_key()
        if self.key is None:
            log.error("vLLM route guard: %s is not set; every guarded route is refused",
                      KEY_ENV)
        self.nonces = Nonces()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or not is_guarded(
                scope["path"], scope.get("root_path", "")):
            return await self.app(scope, receive, send)
        method = scope.get("method", "WEBSOCKET")
        raw = scope.get("raw_path") or scope["path"].encode()
        target = raw.decode("latin-1") + (
            "?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        what = f"{method} {target} from {(scope.get('client') or ('?',))[0]}"
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        reason = "bad length" if length < 0 else check_head(
            self.key, method, target, headers, length, self.nonces, now=self.clock())
        if reason is None and scope["type"] == "websocket":
            reason = "websocket"
        body = b""
        if reason is None:
            body, complete = await _read_body(receive, length)
            reason = check_body(self.key, method, target, headers, body, self.nonces,
                                now=self.clock()) if complete else "body length"
        if reason is not None:
            count_refused(reason, what)
            return await _refuse(scope, receive, send, reason)
        return await self.app(scope, _replay(body, receive), send)


async def _read_body(receive: Callable, length: int) -> tuple[bytes, bool]:
    """The body, and whether it is as long as the request said (never more is kept)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"", False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > length:
            return b"", False
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), size == length


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _refuse(scope: dict, receive: Callable, send: Callable, reason: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    text = json.dumps({"error": f"wt route guard: {reason}"}).encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(text)).encode()),
                            (GUARD_HEADER.encode(), b"refused")]})
    await send({"type": "http.response.body", "body": text})
