"""Driver side of our backend in a ``vllm serve`` server, through vLLM's own RL HTTP routes.

The server is the user's, started with our backend and vLLM's development
routes (``VLLM_SERVER_DEV_MODE=1``)::

    WT_VLLM_KEY=<key> VLLM_SERVER_DEV_MODE=1 \\
        vllm serve MODEL --weight-transfer-config '{"backend": "wt_onesided"}' \\
        --middleware weight_transfer.engines.vllm.guard.RouteGuard

    link = HttpLink("http://10.0.0.7:8000", key=key, reply_host="10.0.0.5", pause_mode="keep")
    metas = link.setup(SetupRequest(...))   # POST /init_weight_transfer_engine, replies on
                                            # the authenticated channel (.channel)
    link.pause()         # POST /pause?mode=keep, then /start_weight_update
    ...                  # the trainers write one-sided into the workers' registered memory
    link.resume(7)       # /finish_weight_update {"weight_version": "7"}, /reset_prefix_cache,
                         # /resume: requests go on; their outputs' weight_versions say 7

``pause_mode`` is vLLM's: ``abort`` (requests in flight end, aborted),
``wait`` (they finish first), ``keep`` (they are frozen and continue after the
resume; ``recompute=True``, the default, resets the prefix cache with
``reset_running_requests=true`` so their KV is recomputed with the new
weights, as the offline driver does). The same interface as
:class:`~weight_transfer.engines.vllm.driver.VllmLink` (``setup``, ``call``,
``pause``, ``resume``, ``set_version``, ``version``, ``generate``,
``gate.paused``, ``close``), so the Ray owner drives either. Standard library
HTTP only. Every request to a route the server's guard keeps for the controller
(:data:`~weight_transfer.engines.vllm.guard.GUARDED`) is signed with the key
(:func:`~weight_transfer.engines.vllm.guard.sign_headers`); :meth:`HttpLink.check_guard`
tells whether the server runs that guard and accepts the key.

A LoRA adapter (:class:`~weight_transfer.engines.vllm.lora.link.LoraLink` over this link,
the server started with ``--enable-lora --max-loras 3 --max-lora-rank R``) is served by
name: requests send ``"model": name``. Its ``lora_setup`` also serves the name as the
adapter's id in the server's name table (the guard's route ``/wt/lora_name``,
:mod:`weight_transfer.engines.vllm.guard.lora_names`), its ``lora_close`` first takes the
name out; a flip or a rollback runs at :meth:`HttpLink.at_step_boundary` (``/pause?mode=keep``,
the swap, ``/reset_prefix_cache``, ``/resume``)::

    lora = LoraLink(link, name="policy", lora_int_id=1)
    lora.setup(describe_peft(peft_model), nics=(("inode0/nic0",),))  # "policy" now resolves
    slot = lora.begin(); ...; lora.flip(version=3)                   # the trainers wrote it
    link.generate(prompts, 8, lora_request=lora.request())           # {"model": "policy"}
    lora.close()                                                     # slots freed, name gone

Over HTTP there are no engine-step timestamps, so the adapter version of each token is
not known (``LoraLink.generate_tagged`` is refused); :meth:`HttpLink.generate_tagged`
gives the base weights' versions the server reports. A server with several API server
processes (``--api-server-count``) keeps a name table in each: the route refuses it.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from weight_transfer.engines.vllm.channel import KEY_ENV, ReplyChannel
from weight_transfer.engines.vllm.driver import TokensOfTagged, timed_boundary
from weight_transfer.engines.vllm.guard import (
    GUARD_HEADER,
    IMPORT_PATH,
    is_guarded,
    sign_headers,
)
from weight_transfer.engines.vllm.guard.lora_names import ROUTE as LORA_NAMES
from weight_transfer.engines.vllm.mailbox import SetupRequest
from weight_transfer.sync.versions import Generation, from_vllm
from weight_transfer.types import EngineRankMeta

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class PauseFlag:
    """Whether the link paused the engine (the owner reads ``gate.paused``)."""

    paused: bool = False


class HttpError(RuntimeError):
    """A route of the vLLM server failed; names the route and the server's answer."""


class HttpLink(TokensOfTagged):
    """Our backend in every worker of one vLLM server; see the module docstring."""

    def __init__(self, url: str, *, key: bytes | str, reply_host: str = "127.0.0.1",
                 pause_mode: str = "keep", recompute: bool = True,
                 timeout_s: float = 600.0, reply_timeout_s: float = 60.0) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r}: one of {', '.join(PAUSE_MODES)}")
        self.url, self.pause_mode, self.recompute = url.rstrip("/"), pause_mode, recompute
        self.timeout_s = timeout_s
        self.box = ReplyChannel(reply_host, key, timeout_s=reply_timeout_s)
        self.gate = PauseFlag()
        self._updating = False
        self._lock = threading.Lock()
        self.lora_names: dict[str, int] = {}  # names this link serves -> their adapter ids
        self.tp_size = int(self.get("/get_world_size?include_dp=false")["world_size"])

    # ------------------------------------------------------------------ HTTP

    def request(self, method: str, route: str, body: Any = None,
                timeout_s: float | None = None) -> Any:
        """One call of a route (signed where the guard wants it); its JSON answer (None if
        empty). HttpError naming the route."""
        data = None if body is None else json.dumps(body).encode()
        status, _, text = self._send(method, route, data, timeout_s, sign=is_guarded(
            route.split("?", 1)[0]))
        if status >= 400:
            raise HttpError(f"{method} {self.url}{route}: HTTP {status}: "
                            f"{text[:2000].decode(errors='replace')}")
        return json.loads(text) if text else None

    def _send(self, method: str, route: str, data: bytes | None, timeout_s: float | None,
              *, sign: bool) -> tuple[int, Any, bytes]:
        """(status, headers, body) of one request; HttpError if the server is not reached."""
        headers = {"Content-Type": "application/json"}
        if sign:
            headers.update(sign_headers(self.box.key, method, route, data or b""))
        req = urllib.request.Request(self.url + route, data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers, exc.read()
        except urllib.error.URLError as exc:
            raise HttpError(f"{method} {self.url}{route}: {exc.reason} (is the server up, "
                            "with VLLM_SERVER_DEV_MODE=1?)") from None

    def check_guard(self, *, allow_unguarded: bool = False) -> bool:
        """Whether the server runs our route guard and accepts this link's key: an unsigned
        ``GET /start_weight_update`` (a method the route does not take: nothing happens
        anywhere) must get the guard's 403, a signed one must pass it. A server without the
        guard raises RuntimeError, unless ``allow_unguarded`` (then a warning, and False); a
        guard that refuses the key raises ValueError."""
        probe = "/start_weight_update"
        status, headers, _ = self._send("GET", probe, None, 30.0, sign=False)
        if not (status == 403 and headers.get(GUARD_HEADER) == "refused"):
            if not allow_unguarded:
                raise RuntimeError(
                    f"vLLM server {self.url} runs without our route guard (an unsigned GET "
                    f"{probe} got HTTP {status}): anyone who reaches it can pause, resume or "
                    f"end an update. Start it with --middleware {IMPORT_PATH}, or pass "
                    "allow_unguarded=True to connect anyway")
            log.warning("vLLM server %s runs without our route guard (--middleware %s): its "
                        "RL routes (/pause, /resume, /finish_weight_update, ...) are open to "
                        "anyone who reaches it; connected because allow_unguarded=True",
                        self.url, IMPORT_PATH)
            return False
        status, headers, text = self._send("GET", probe, None, 30.0, sign=True)
        if status == 403 and headers.get(GUARD_HEADER) == "refused":
            raise ValueError(f"vLLM server {self.url}: its route guard refused this link's "
                             f"signature ({text[:200].decode(errors='replace')}): is its "
                             f"{KEY_ENV} the controller's key, its clock within a minute?")
        return True

    def get(self, route: str) -> Any:
        return self.request("GET", route)

    def post(self, route: str, body: Any = None, timeout_s: float | None = None) -> Any:
        return self.request("POST", route, {} if body is None else body, timeout_s)

    # ------------------------------------------------------------------ backend operations

    def call(self, op: str, request: Any = None, *, rank: int = -1) -> list[Any]:
        """Run ``op`` in the worker of TP rank ``rank`` (-1: every rank); their replies. An
        adapter's ``lora_setup`` then serves its name (:meth:`serve_lora`; a refusal gives
        the slots back), its ``lora_close`` first serves the name no more."""
        if op == "lora_close":
            try:
                self.unserve_lora(request)
            except ValueError as exc:  # the name serves another adapter: not ours to take
                log.warning("%s: adapter %r closed, its name left as it is: %s", self.url,
                            request, exc)
        replies = self._in_workers(op, request, rank)
        if op == "lora_setup":
            self._serve_set_up(request)
        return replies

    def _in_workers(self, op: str, request: Any, rank: int) -> list[Any]:
        with self._lock:
            info = self.box.post(op, request, rank=rank)
            self.post("/init_weight_transfer_engine", {"init_info": info})
            return self.box.replies(info, range(self.tp_size) if rank < 0 else [rank])

    def setup(self, request: SetupRequest) -> list[EngineRankMeta]:
        return self.call("setup", request)

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        """vLLM's ``collective_rpc`` through the dev route ``/collective_rpc``: a worker method
        by name (e.g. a worker extension's), its arguments sent as strings; the workers'
        JSON results."""
        if not isinstance(method, str):
            raise ValueError(f"{self.url}: collective_rpc over HTTP calls a worker method by "
                             f"name, not {method!r}")
        return self.post("/collective_rpc", {"method": method,
                                             "args": [str(a) for a in args]})["results"]

    # ------------------------------------------------------------------ served adapter names

    def serve_lora(self, name: str, lora_int_id: int) -> None:
        """Requests naming ``name`` (``"model": name``) run with adapter id ``lora_int_id``,
        which the workers hold (``lora_setup``). ValueError with the server's reason if it
        refuses (the name served as another adapter, the id under another name, several
        API server processes, an id the engine does not hold): nothing changed."""
        self._names_route("POST", {"name": name, "lora_int_id": lora_int_id})
        self.lora_names[name] = lora_int_id

    def unserve_lora(self, name: str, lora_int_id: int | None = None) -> None:
        """Requests naming ``name`` are refused from now (HTTP 404), if it names our adapter
        (``lora_int_id``: the id it was served as; default: this link's record, else the
        server's table)."""
        if lora_int_id is None:
            lora_int_id = self.lora_names.get(name)
        if lora_int_id is None:
            lora_int_id = self.lora_table().get(name)
        if lora_int_id is not None:
            self._names_route("DELETE", {"name": name, "lora_int_id": lora_int_id})
        self.lora_names.pop(name, None)

    def lora_table(self) -> dict[str, int]:
        """Every name the server resolves to an adapter, with its id (ours and vLLM's)."""
        return self._names_route("GET")["names"]

    def _serve_set_up(self, setup: Any) -> None:
        """Serve the name of an adapter just set up; if refused, give its slots back."""
        try:
            self.serve_lora(setup.name, setup.lora_int_id)
        except BaseException:
            try:
                self._in_workers("lora_close", setup.name, -1)
            except Exception as exc:  # the refusal is the error to report
                log.warning("%s: adapter %r not closed after its name was refused: %s",
                            self.url, setup.name, exc)
            raise

    def _names_route(self, method: str, body: Any = None) -> Any:
        """One signed call of the guard's ``/wt/lora_name``; ValueError when the server
        refuses the request (400, 409), HttpError otherwise."""
        data = None if body is None else json.dumps(body).encode()
        status, headers, text = self._send(method, LORA_NAMES, data, None, sign=True)
        if status in (400, 409):
            raise ValueError(f"{self.url}: {json.loads(text).get('error', text)}")
        if status >= 400:
            hint = (f"is its {KEY_ENV} the controller's key?"
                    if headers.get(GUARD_HEADER) == "refused" else
                    f"does the server run our route guard, --middleware {IMPORT_PATH}?")
            raise HttpError(f"{method} {self.url}{LORA_NAMES}: HTTP {status}: "
                            f"{text[:2000].decode(errors='replace')} ({hint})")
        return json.loads(text)

    # ------------------------------------------------------------------ updates

    def pause(self, timeout_s: float = 60.0) -> None:
        """vLLM's pause in ``pause_mode``, then its update session (idempotent)."""
        if not self.gate.paused:
            self.post(f"/pause?mode={self.pause_mode}", timeout_s=timeout_s)
            self.gate.paused = True
        if not self._updating:
            self.post("/start_weight_update")
            self._updating = True

    def resume(self, version: Any = None) -> None:
        """Finish the update session with ``version``, reset the prefix cache, resume."""
        if self._updating:
            self.post("/finish_weight_update",
                      {"weight_version": None if version is None else str(version)})
            self._updating = False
        elif version is not None:
            self.set_version(version)
        self._reset_prefix_cache(version)
        self.post("/resume")
        self.gate.paused = False

    def at_step_boundary(self, fn: Callable[[], None], version: Any = None) -> float:
        """``fn`` with the server's scheduler paused in mode ``keep`` (``/pause?mode=keep``: a
        step boundary, requests frozen, none dropped), then ``/reset_prefix_cache`` and
        ``/resume`` (also when ``fn`` raised). Returns the seconds from the pause to serving
        again; ``version``: for the log only. Refused while a full-weight update is open."""
        if self._updating:
            raise ValueError("at_step_boundary: a full-weight update is in progress "
                             "(resume it first)")

        def stop() -> None:
            self.post("/pause?mode=keep")
            self.gate.paused = True

        def go() -> None:
            self.post("/resume")
            self.gate.paused = False

        return timed_boundary(fn, stop=stop, reset=lambda: self._reset_prefix_cache(version),
                              go=go)

    def _reset_prefix_cache(self, version: Any) -> None:
        running = "true" if self.recompute else "false"
        if not self.post(f"/reset_prefix_cache?reset_running_requests={running}").get("success"):
            log.warning("%s did not reset its prefix cache after version %s", self.url, version)

    def set_version(self, version: Any) -> None:
        self.post("/update_weight_version",
                  {"new_version": "none" if version is None else str(version)})

    def version(self) -> str:
        return self.get("/weight_info")["weight_version"]

    # ------------------------------------------------------------------ generation

    def generate_tagged(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                        temperature: float = 0.0, seed: int | None = None,
                        lora_request: Any = None,
                        on_step: Callable[[int, int, float | None], None] | None = None
                        ) -> list[Generation]:
        """Generations from token ids through ``/inference/v1/generate`` (the server needs
        ``--enable-scale-out``), each with the base weights' versions the server reports
        (vLLM's ``weight_versions``); greedy unless ``temperature`` > 0 (request ``i`` seeded
        ``seed + i``). ``lora_request``: an adapter's ``LoRARequest`` (or its name), sent as
        ``"model": name``. ``on_step`` is refused: the server reports no engine-step
        timestamps, so which adapter version made which token cannot be told."""
        if on_step is not None:
            raise ValueError(
                f"{self.url}: a vLLM server reports no engine-step timestamps over HTTP, so "
                "the adapter version of each token cannot be told (on_step, "
                "LoraLink.generate_tagged); generate under the adapter with "
                "generate(..., lora_request=) and read LoraLink.version")
        from weight_transfer.engines.vllm.stream import Span

        model = getattr(lora_request, "lora_name", lora_request)
        out = []
        for i, p in enumerate(prompts):
            params = {"max_tokens": max_new_tokens, "temperature": temperature,
                      "detokenize": False, **({} if seed is None else {"seed": seed + i})}
            body = {"token_ids": list(p), "sampling_params": params,
                    **({} if model is None else {"model": model})}
            choice = self.post("/inference/v1/generate", body)["choices"][0]
            out.append(from_vllm(choice["token_ids"], [
                Span(version=s["version"], start=s["start"], end=s["end"])
                for s in choice.get("weight_versions") or ()]))
        return out

    def close(self) -> None:
        """Close our backend in the workers (every adapter's slots too, their names first)."""
        try:
            for name in list(self.lora_names):
                try:
                    self.unserve_lora(name)
                except (HttpError, ValueError) as exc:  # the close goes on
                    log.warning("%s: adapter name %r still served: %s", self.url, name, exc)
            self.call("close")
        finally:
            self.box.close()
