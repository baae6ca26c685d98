"""The guard's own route ``/wt/lora_name`` (weight_transfer/engines/vllm/guard/lora_names.py) as an
ASGI app with crafted scopes and a fake API server state, no vLLM: a signed POST serves a name
as our adapter id in the server's name table (vLLM's app never sees it), DELETE takes it out,
GET lists the table; unsigned or wrongly signed calls get 403, bad input 400 naming the
field, a server with several API server processes or an engine without the id 409, and each
refusal leaves the table as it was."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from weight_transfer.engines.vllm import guard
from weight_transfer.engines.vllm.channel import new_key, parse_key
from weight_transfer.engines.vllm.guard import RouteGuard, lora_names, sign_headers

KEY = parse_key(new_key())
NOW = 1_800_000_000.0
ROUTE = lora_names.ROUTE


@dataclass(frozen=True)
class FakeRequest:
    """vLLM's LoRARequest as the route reads it."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int) -> int:
        self.value += n
        return self.value


class Models:
    """OpenAIServingModels as the route uses it: the name table, base names, the id counter."""

    def __init__(self) -> None:
        self.lora_requests: dict[str, FakeRequest] = {}
        self.lora_id_counter = Counter()

    def is_base_model(self, name: str) -> bool:
        return name == "tiny-llama"


class Engine:
    def __init__(self, held: set[int]) -> None:
        self.held = held

    async def list_loras(self) -> set[int]:
        return set(self.held)


class App:
    """vLLM's app behind the guard: records what reached it."""

    def __init__(self, api_servers: int | None = None) -> None:
        self.calls: list[str] = []
        self.state = SimpleNamespace(openai_serving_models=Models(), engine_client=Engine({1, 7}),
                                     args=SimpleNamespace(api_server_count=api_servers))

    async def __call__(self, scope, receive, send) -> None:
        self.calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture(autouse=True)
def fake_lora_request(monkeypatch):
    monkeypatch.setattr(lora_names, "lora_request", lambda req: FakeRequest(
        req.name, req.lora_int_id, lora_names.placeholder(req.name)))
    guard.REFUSED.clear()


def call(app: App, method: str, body=None, *, key=KEY, sign=True) -> tuple[int, dict]:
    data = b"" if body is None else (body if isinstance(body, bytes) else
                                     json.dumps(body).encode())
    headers = {"content-length": str(len(data))}
    if sign:
        headers |= sign_headers(key, method, ROUTE, data, now=NOW)
    scope = {"type": "http", "method": method, "path": ROUTE, "raw_path": ROUTE.encode(),
             "query_string": b"", "root_path": "", "client": ("10.0.0.9", 4000), "app": app,
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    messages = [{"type": "http.request", "body": data, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(RouteGuard(app, key=KEY, clock=lambda: NOW)(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def table(app: App) -> dict[str, tuple[int, str]]:
    return {n: (r.lora_int_id, r.lora_path)
            for n, r in app.state.openai_serving_models.lora_requests.items()}


def test_a_signed_post_serves_the_name_as_our_id_and_delete_takes_it_out():
    app = App()
    assert call(app, "POST", {"name": "policy", "lora_int_id": 7}) == (
        200, {"name": "policy", "lora_int_id": 7, "changed": True})
    assert table(app) == {"policy": (7, "wt-onesided://policy")}
    assert app.state.openai_serving_models.lora_id_counter.value == 7  # vLLM's ids go past it
    assert call(app, "POST", {"name": "policy", "lora_int_id": 7})[1]["changed"] is False
    assert call(app, "GET") == (200, {"names": {"policy": 7}})
    assert call(app, "DELETE", {"name": "policy", "lora_int_id": 7})[1]["changed"] is True
    assert table(app) == {}
    assert call(app, "DELETE", {"name": "policy", "lora_int_id": 7}) == (
        200, {"name": "policy", "lora_int_id": 7, "changed": False})
    assert app.calls == []  # answered by the guard; vLLM's app never saw the route


@pytest.mark.parametrize("how", ["unsigned", "another key"])
def test_an_outsider_is_refused_and_nothing_changes(how):
    app = App()
    call(app, "POST", {"name": "policy", "lora_int_id": 1})
    before = table(app)
    for method, body in (("POST", {"name": "evil", "lora_int_id": 7}),
                         ("DELETE", {"name": "policy", "lora_int_id": 1}), ("GET", None)):
        status, answer = call(app, method, body, sign=how != "unsigned",
                              key=parse_key(new_key()))
        assert status == 403 and answer["error"].startswith("wt route guard:"), answer
    assert table(app) == before and app.calls == []


@pytest.mark.parametrize("body, what", [
    ({"lora_int_id": 1}, "field 'name' must be a non-empty string, not None"),
    ({"name": " ", "lora_int_id": 1}, "field 'name' must be a non-empty string"),
    ({"name": 3, "lora_int_id": 1}, "field 'name' must be a non-empty string, not 3"),
    ({"name": "policy"}, "field 'lora_int_id' of 'policy' must be an integer >= 1, not None"),
    ({"name": "policy", "lora_int_id": "1"}, "must be an integer >= 1, not '1'"),
    ({"name": "policy", "lora_int_id": 1.5}, "must be an integer >= 1, not 1.5"),
    ({"name": "policy", "lora_int_id": True}, "must be an integer >= 1, not True"),
    ({"name": "policy", "lora_int_id": 0}, "must be an integer >= 1, not 0"),
    ([1, 2], "must be a JSON object"),
    (b"{not json", "the body is not JSON"),
    ({"name": "tiny-llama", "lora_int_id": 1}, "'tiny-llama' is the name of a base model"),
    ({"name": "policy", "lora_int_id": 2}, r"'policy' is served already, as adapter id 1"),
    ({"name": "critic", "lora_int_id": 1}, "adapter id 1 is served already as 'policy'"),
    ({"name": "disk", "lora_int_id": 5}, r"'disk' is served already, as adapter id 5 from "
                                         r"'/ckpt/disk'"),
])
def test_bad_input_is_refused_by_name_with_400_and_nothing_changes(body, what):
    app = App()
    call(app, "POST", {"name": "policy", "lora_int_id": 1})
    app.state.openai_serving_models.lora_requests["disk"] = FakeRequest("disk", 5, "/ckpt/disk")
    before = table(app)
    status, answer = call(app, "POST", body)
    assert status == 400 and what.replace("\\", "") in answer["error"], answer
    assert table(app) == before


def test_delete_leaves_a_name_of_another_adapter_alone():
    app = App()
    app.state.openai_serving_models.lora_requests["disk"] = FakeRequest("disk", 5, "/ckpt/disk")
    call(app, "POST", {"name": "policy", "lora_int_id": 1})
    for body, what in (({"name": "disk", "lora_int_id": 5}, "from '/ckpt/disk'"),
                       ({"name": "policy", "lora_int_id": 7}, "served as adapter id 1")):
        status, answer = call(app, "DELETE", body)
        assert status == 400 and what in answer["error"], answer
    assert set(table(app)) == {"disk", "policy"}


def test_an_id_the_engine_does_not_hold_or_several_api_servers_are_refused_with_409():
    app = App()
    status, answer = call(app, "POST", {"name": "policy", "lora_int_id": 3})
    assert status == 409 and "holds no adapter id 3 (it holds [1, 7])" in answer["error"]
    several = App(api_servers=2)
    status, answer = call(several, "POST", {"name": "policy", "lora_int_id": 1})
    assert status == 409 and "2 API server processes" in answer["error"], answer
    assert call(several, "GET") == (200, {"names": {}})  # reads still answer
    assert table(app) == table(several) == {}
    assert call(app, "PUT", {"name": "policy", "lora_int_id": 1})[0] == 405
