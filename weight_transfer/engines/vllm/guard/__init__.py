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

One guarded route is the guard's own, answered in the API server process once its
signature passed: ``/wt/lora_name`` serves a name as the id of a LoRA adapter our workers
hold (:mod:`.lora_names`; ``HttpLink`` calls it at an adapter's setup and close).
"""

from weight_transfer.engines.vllm.guard.middleware import (
    GUARD_HEADER,
    LOG_EVERY_S,
    REFUSED,
    RouteGuard,
    count_refused,
)
from weight_transfer.engines.vllm.guard.routes import GUARDED, is_guarded, route_of
from weight_transfer.engines.vllm.guard.signing import (
    MAX_BODY,
    WINDOW_S,
    Nonces,
    check_body,
    check_head,
    sign_headers,
)

IMPORT_PATH = "weight_transfer.engines.vllm.guard.RouteGuard"

__all__ = ["GUARDED", "GUARD_HEADER", "IMPORT_PATH", "LOG_EVERY_S", "MAX_BODY", "REFUSED",
           "WINDOW_S", "Nonces", "RouteGuard", "check_body", "check_head", "count_refused",
           "is_guarded", "route_of", "sign_headers"]
