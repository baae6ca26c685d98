"""The guard as an ASGI middleware (what vLLM's ``--middleware`` adds around its app):
refusals answered with 403, counted and logged; a signed request to one of the guard's own
routes (:data:`OWN_ROUTES`) answered here, in the API server process; see the package
docstring."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from weight_transfer.engines.vllm.channel import KEY_ENV, parse_key
from weight_transfer.engines.vllm.guard import lora_names
from weight_transfer.engines.vllm.guard.routes import is_guarded, route_of
from weight_transfer.engines.vllm.guard.signing import Nonces, check_body, check_head

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
GUARD_HEADER = "x-wt-guard"
REFUSED: dict[str, int] = {}  # reason -> requests refused, in this server process
_last_log: dict[str, tuple[float, int]] = {}
_lock = threading.Lock()
# Routes the guard answers itself once their signature passed (vLLM has no such route):
# route -> handler(scope, method, body, send).
OWN_ROUTES: dict[str, Callable] = {lora_names.ROUTE: lora_names.serve}


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
        own = OWN_ROUTES.get(route_of(scope["path"], scope.get("root_path", "")))
        if own is not None:
            return await own(scope, method, body, send)
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
