"""The guard's own route ``/wt/lora_name``: the served name of an adapter we write one-sided.

A ``vllm serve`` server resolves ``"model": name`` in a request (``/v1/completions``,
``/inference/v1/generate``, ...) through its API server's ``OpenAIServingModels.lora_requests``
(name -> ``LoRARequest``). vLLM's own ways in (``/v1/load_lora_adapter``, a
``LoRAResolver``) pick the id from their counter and load the path from disk; an adapter
whose slots our workers own (:mod:`weight_transfer.engines.vllm.lora.slots`) needs its name
to resolve to the id pinned there, with a path vLLM never reads. The route, handled by
:class:`~.middleware.RouteGuard` in the API server process once the request's signature
passed (it is in :data:`~.routes.GUARDED`)::

    POST   /wt/lora_name {"name": "policy", "lora_int_id": 1}   # name -> LoRARequest(name, 1,
                                                                 #   "wt-onesided://policy")
    DELETE /wt/lora_name {"name": "policy", "lora_int_id": 1}   # the name served no more
    GET    /wt/lora_name                                         # {"names": {name: id, ...}}

Refused with HTTP 400, naming the field, and nothing changed: a missing or empty name, an
id that is not an integer >= 1, a name of a base model, a name served under another id
or loaded from a path, an id another name is served under. A registration the engine
holds no adapter id for is refused with 409 (set the adapter up first: ``lora_setup``);
so is every change on a server with more than one API server process
(``--api-server-count``): each process keeps its own name table and a request reaches
one of them. Registering a name again under its id changes nothing; removing a name that
is not served is not an error. vLLM's own id counter is moved past a registered id, so an
adapter vLLM loads later never takes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ROUTE = "/wt/lora_name"


class NameRefused(ValueError):
    """A request to the route that is refused: the HTTP status and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True, kw_only=True)
class NameRequest:
    """A served name and the adapter id it resolves to."""

    name: str
    lora_int_id: int


def parse_request(method: str, body: bytes) -> NameRequest | None:
    """The request of a ``POST`` or ``DELETE`` (None for ``GET``); NameRefused (400, 405)
    naming what is wrong."""
    if method == "GET":
        return None
    if method not in ("POST", "DELETE"):
        raise NameRefused(405, f"{ROUTE}: method {method} (GET, POST or DELETE)")
    try:
        data = json.loads(body or b"null")
    except ValueError as exc:
        raise NameRefused(400, f"{ROUTE}: the body is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise NameRefused(400, f'{ROUTE}: the body must be a JSON object {{"name": ..., '
                               f'"lora_int_id": ...}}, not {type(data).__name__}')
    name, lora_id = data.get("name"), data.get("lora_int_id")
    if not isinstance(name, str) or not name.strip():
        raise NameRefused(400, f"{ROUTE}: field 'name' must be a non-empty string, "
                               f"not {name!r}")
    if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
        raise NameRefused(400, f"{ROUTE}: field 'lora_int_id' of {name!r} must be an "
                               f"integer >= 1, not {lora_id!r}")
    return NameRequest(name=name, lora_int_id=lora_id)


def placeholder(name: str) -> str:
    """The path of a served name's ``LoRARequest`` (the one ``LoraLink.request`` gives)."""
    from weight_transfer.engines.vllm.lora.link import PLACEHOLDER_PATH

    return PLACEHOLDER_PATH.format(name=name)


def names(models: Any) -> dict[str, int]:
    """Every name the server resolves to an adapter, with its id (ours and vLLM's)."""
    return {n: r.lora_int_id for n, r in models.lora_requests.items()}


def check_register(models: Any, req: NameRequest) -> bool:
    """Whether ``req`` changes the table (False: it is there already); NameRefused (400)
    naming the conflict."""
    if models.is_base_model(req.name):
        raise NameRefused(400, f"{ROUTE}: {req.name!r} is the name of a base model served")
    held = models.lora_requests.get(req.name)
    if held is not None:
        if held.lora_int_id == req.lora_int_id and held.lora_path == placeholder(req.name):
            return False
        raise NameRefused(400, f"{ROUTE}: {req.name!r} is served already, as adapter id "
                               f"{held.lora_int_id} from {held.lora_path!r}: unregister it "
                               "first, or serve this adapter under another name")
    other = [n for n, i in names(models).items() if i == req.lora_int_id]
    if other:
        raise NameRefused(400, f"{ROUTE}: adapter id {req.lora_int_id} is served already as "
                               f"{other[0]!r}; one id, one name")
    return True


def lora_request(req: NameRequest) -> Any:
    """vLLM's ``LoRARequest`` of a served name: the id our workers pin, a path never read."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(req.name, req.lora_int_id, placeholder(req.name))


def register(models: Any, req: NameRequest) -> dict[str, Any]:
    """Serve ``req.name`` as adapter id ``req.lora_int_id`` (see the module docstring)."""
    if not check_register(models, req):
        return {"name": req.name, "lora_int_id": req.lora_int_id, "changed": False}
    models.lora_requests[req.name] = lora_request(req)
    counter = getattr(models, "lora_id_counter", None)
    if counter is not None and counter.value < req.lora_int_id:
        counter.inc(req.lora_int_id - counter.value)
    return {"name": req.name, "lora_int_id": req.lora_int_id, "changed": True}


def unregister(models: Any, req: NameRequest) -> dict[str, Any]:
    """Serve ``req.name`` no more; NameRefused (400) if it names another adapter."""
    held = models.lora_requests.get(req.name)
    if held is None:
        return {"name": req.name, "lora_int_id": req.lora_int_id, "changed": False}
    if held.lora_int_id != req.lora_int_id or held.lora_path != placeholder(req.name):
        raise NameRefused(400, f"{ROUTE}: {req.name!r} is served as adapter id "
                               f"{held.lora_int_id} from {held.lora_path!r}, not as our "
                               f"adapter id {req.lora_int_id}: left as it is")
    del models.lora_requests[req.name]
    return {"name": req.name, "lora_int_id": req.lora_int_id, "changed": True}


def api_servers(state: Any) -> int:
    """How many API server processes the server runs (each with its own name table)."""
    args = getattr(state, "args", None)
    return int(getattr(args, "api_server_count", None) or 1)


async def answer(state: Any, method: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """The route's (status, JSON answer) against the app state ``state``."""
    try:
        req = parse_request(method, body)
        models = getattr(state, "openai_serving_models", None)
        if models is None or not hasattr(models, "lora_requests"):
            raise NameRefused(503, f"{ROUTE}: this server has no model table (not started, "
                                   "or not a generation server)")
        if req is None:
            return 200, {"names": names(models)}
        if (count := api_servers(state)) > 1:
            raise NameRefused(409, f"{ROUTE}: this server runs {count} API server processes "
                                   "(--api-server-count), each with its own name table; a "
                                   "name registered in one is unknown to the others: serve "
                                   "adapters with --api-server-count 1")
        if method == "DELETE":
            return 200, unregister(models, req)
        if check_register(models, req):
            await check_engine_holds(state, req)
        return 200, register(models, req)
    except NameRefused as exc:
        return exc.status, {"error": str(exc)}


async def check_engine_holds(state: Any, req: NameRequest) -> None:
    """NameRefused (409) unless the engine holds adapter id ``req.lora_int_id``: a name
    resolving to an id in no slot would make vLLM load our placeholder path."""
    engine = getattr(state, "engine_client", None)
    if engine is None or not hasattr(engine, "list_loras"):
        return
    held = await engine.list_loras()
    if req.lora_int_id not in held:
        raise NameRefused(409, f"{ROUTE}: the engine holds no adapter id {req.lora_int_id} "
                               f"(it holds {sorted(held)}): set {req.name!r} up first "
                               "(lora_setup), then serve its name")


async def serve(scope: Mapping[str, Any], method: str, body: bytes,
                send: Callable) -> None:
    """Answer one request to the route (the guard let it through) as JSON."""
    app = scope.get("app")
    status, content = await answer(getattr(app, "state", None), method, body)
    text = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(text)).encode())]})
    await send({"type": "http.response.body", "body": text})
