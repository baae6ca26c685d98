"""The route guard of a served vLLM (weight_transfer/engines/vllm/guard/) as an ASGI app, with
crafted scopes and no vLLM: a request signed with the key passes with its body intact; an
unsigned one, one signed with another key, a stale one, a replayed nonce and a tampered body or
query are refused with 403, the reason and the guard's header, and counted; a read route
passes untouched."""

from __future__ import annotations

import asyncio
import json

import pytest

from weight_transfer.engines.vllm import guard
from weight_transfer.engines.vllm.channel import new_key, parse_key
from weight_transfer.engines.vllm.guard import GUARD_HEADER, RouteGuard, sign_headers

KEY = parse_key(new_key())
NOW = 1_800_000_000.0


class App:
    """The app behind the guard: records what reached it, with the body it read."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        self.calls.append((scope["path"], message.get("body", b"")))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(gate: RouteGuard, method: str, target: str, body: bytes = b"",
         headers: dict[str, str] | None = None, chunks: int = 1) -> tuple[int, dict, bytes]:
    path, _, query = target.partition("?")
    hdrs = {"content-length": str(len(body)), **(headers or {})}
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": query.encode(), "root_path": "", "client": ("10.0.0.9", 4000),
             "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()]}
    step = max(1, len(body) // chunks)
    parts = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
                for i, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(gate(scope, receive, send))
    start = sent[0]
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.fixture
def gate():
    guard.REFUSED.clear()
    app = App()
    g = RouteGuard(app, key=KEY, clock=lambda: NOW)
    g.inner = app
    return g


def signed(method, target, body=b"", *, key=KEY, now=NOW, nonce=None):
    return sign_headers(key, method, target, body, now=now, nonce=nonce)


def test_a_signed_request_passes_with_its_body(gate):
    body = json.dumps({"weight_version": "7"}).encode() * 50
    status, _, _ = call(gate, "POST", "/finish_weight_update", body,
                        signed("POST", "/finish_weight_update", body), chunks=4)
    assert status == 200 and gate.inner.calls == [("/finish_weight_update", body)]
    status, _, _ = call(gate, "POST", "/pause?mode=keep", b"{}",
                        signed("POST", "/pause?mode=keep", b"{}"))
    assert status == 200 and guard.REFUSED == {}


@pytest.mark.parametrize(("case", "reason"), [
    ("unsigned", "unsigned"),
    ("other key", "bad signature"),
    ("stale", "stale time"),
    ("future", "stale time"),
    ("body tampered", "bad signature"),
    ("body longer", "bad signature"),
    ("query tampered", "bad signature"),
    ("other route", "bad signature"),
    ("other method", "bad signature"),
])
def test_a_request_not_signed_for_what_it_asks_is_refused(gate, case, reason):
    body = b'{"new_version": "1"}'
    route = "/update_weight_version"
    headers = {
        "unsigned": {},
        "other key": signed("POST", route, body, key=parse_key(new_key())),
        "stale": signed("POST", route, body, now=NOW - guard.WINDOW_S - 1),
        "future": signed("POST", route, body, now=NOW + guard.WINDOW_S + 1),
    }.get(case, signed("POST", route, body))
    method, sent = "POST", body
    if case == "body tampered":
        sent = b'{"new_version": "9"}'
    elif case == "body longer":
        sent = body + b" "
    elif case == "query tampered":
        route = route + "?x=1"
    elif case == "other route":
        route = "/resume"
    elif case == "other method":
        method = "PUT"
    status, hdrs, text = call(gate, method, route, sent, headers)
    assert (status, hdrs[GUARD_HEADER]) == (403, "refused")
    assert json.loads(text) == {"error": f"wt route guard: {reason}"}
    assert gate.inner.calls == [] and {reason: 1} == guard.REFUSED


def test_a_replayed_nonce_is_refused(gate):
    headers = signed("POST", "/resume", b"{}")
    assert call(gate, "POST", "/resume", b"{}", headers)[0] == 200
    status, _, text = call(gate, "POST", "/resume", b"{}", headers)
    assert status == 403 and b"replayed nonce" in text
    assert len(gate.inner.calls) == 1 and guard.REFUSED == {"replayed nonce": 1}


def test_a_body_beyond_its_length_is_not_read_past_it(gate):
    headers = signed("POST", "/resume", b"{}")
    status, _, text = call(gate, "POST", "/resume", b"{}" * 10,
                           {**headers, "content-length": "2"})
    assert status == 403 and b"body length" in text and gate.inner.calls == []


@pytest.mark.parametrize("target", ["/health", "/v1/models", "/weight_info", "/is_paused",
                                    "/inference/v1/generate", "/v1/completions"])
def test_reads_pass_untouched(gate, target):
    assert call(gate, "GET", target)[0] == 200
    assert gate.inner.calls == [(target, b"")] and guard.REFUSED == {}


@pytest.mark.parametrize("path", ["/pause/", "/pause", "/collective_rpc", "/sleep",
                                  "/v1/load_lora_adapter"])
def test_each_spelling_of_a_guarded_route_is_guarded(gate, path):
    assert call(gate, "POST", path, b"{}")[0] == 403
    assert guard.route_of("/api/pause", "/api") == "/pause"


def test_without_a_key_every_guarded_route_is_refused(monkeypatch):
    monkeypatch.delenv("WT_VLLM_KEY", raising=False)
    guard.REFUSED.clear()
    g = RouteGuard(App(), clock=lambda: NOW)
    status, _, text = call(g, "POST", "/resume", b"{}", signed("POST", "/resume", b"{}"))
    assert status == 403 and b"no key" in text
    assert call(g, "GET", "/health")[0] == 200


def test_refusals_are_logged_at_most_once_per_interval(caplog):
    guard.REFUSED.clear()
    guard.middleware._last_log.clear()
    with caplog.at_level("WARNING", logger=guard.__name__):
        for i in range(5):
            guard.count_refused("unsigned", "POST /pause", now=100.0 + i)
        guard.count_refused("unsigned", "POST /pause", now=100.0 + guard.LOG_EVERY_S + 1)
    assert guard.REFUSED == {"unsigned": 6}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "5 since the last report" in lines[1], lines


class _Unguarded:
    """A stand-in for a vLLM server started without the guard (loopback, standard library):
    its world size, and 405 for a GET of a POST route, as vLLM answers."""

    def __enter__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                ok = self.path.startswith("/get_world_size")
                text = b'{"world_size": 1}' if ok else b'{"detail": "Method Not Allowed"}'
                self.send_response(200 if ok else 405)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_a_server_without_the_guard_is_refused_unless_allowed(caplog):
    from weight_transfer.engines.vllm.http_link import HttpLink

    with _Unguarded() as url:
        link = HttpLink(url, key=new_key())
        try:
            with pytest.raises(RuntimeError, match=r"without our route guard .*HTTP 405.*"
                                                   r"--middleware weight_transfer\.engines\."
                                                   r"vllm\.guard\.RouteGuard.*allow_unguarded"):
                link.check_guard()
            with caplog.at_level("WARNING"):
                assert link.check_guard(allow_unguarded=True) is False
            assert "allow_unguarded=True" in caplog.text
        finally:
            link.box.close()
