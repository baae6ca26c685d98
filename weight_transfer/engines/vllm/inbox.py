"""The worker's side of one request from the driver: verify it, run it, reply.

:meth:`OneSidedBackend.init_transfer_engine <.backend.OneSidedBackend>` hands every
``init_info`` it acts on to :func:`serve`, in this order:

1. A signed request (it names a reply address, :mod:`.channel`): the worker checks
   its MAC under ``WT_VLLM_KEY``, that its sequence number is new for its session and
   that its reply address is the one the session's first verified request (the setup)
   registered. A request that fails any of these is **dropped**: nothing is
   unpickled, nothing is run, no connection is opened and nothing is signed (else
   the worker would be a signing oracle: a frame under ``WT_VLLM_KEY`` over a
   session, sequence and rank an outsider chose, sent where the outsider said). The
   first refusal of each kind is logged at WARNING, every refusal is counted
   (:func:`refused_requests`, the ``refused_requests`` of the ``stats`` operation);
   the driver that sent it times out naming the key.
2. An unsigned request (the mailbox directory, the same host): refused with a
   ValueError when this process holds ``WT_VLLM_KEY`` (a vLLM meant for remote
   control takes signed requests only; no reply is written where the request says).
3. The operation runs; its value, or the :class:`~.mailbox.Failure` it raised, goes
   back signed to the verified reply address, or into the mailbox.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from weight_transfer.engines.vllm import channel
from weight_transfer.engines.vllm.mailbox import Failure, read_request, write_reply

log = logging.getLogger(__name__)

_refused: collections.Counter[str] = collections.Counter()  # kind -> refusals (this process)
_lock = threading.Lock()


def refused_requests() -> int:
    """Requests this process dropped or refused because it could not verify them."""
    with _lock:
        return sum(_refused.values())


def _refuse(owner: str, kind: str, info: Any, why: str) -> None:
    with _lock:
        _refused[kind] += 1
        first = _refused[kind] == 1
    # An outsider can send many: the first of each kind at WARNING, the rest at DEBUG.
    log.log(logging.WARNING if first else logging.DEBUG,
            "%s: request %r dropped, nothing sent (%s: %s); further %s requests are "
            "counted (refused_requests) and logged at DEBUG", owner, info.op, kind, why, kind)


def serve(info: Any, *, rank: int, owner: str, run: Callable[[Any], Any]) -> None:
    """Verify ``info`` and reply with ``run(request)``; see the module docstring.
    ``rank`` is this worker's TP rank, ``owner`` names it in messages."""
    if not info.reply:
        if os.environ.get(channel.KEY_ENV):
            _refuse(owner, "unsigned", info, f"this vLLM holds {channel.KEY_ENV}")
            raise ValueError(f"unsigned request {info.op!r} refused: this vLLM holds "
                             f"{channel.KEY_ENV}, so every request must be signed")
        value = _run(owner, info, run, lambda: read_request(info.mailbox, info.seq))
        write_reply(info.mailbox, info.seq, rank, value)
        return
    try:
        key = channel.env_key()
        payload = channel.verify_request(info, key)
    except channel.RequestRefused as exc:
        _refuse(owner, exc.kind, info, str(exc))
        return
    except ValueError as exc:  # WT_VLLM_KEY unset or malformed here: nothing can be verified
        _refuse(owner, "no key", info, str(exc))
        return
    value = _run(owner, info, run, lambda: channel.load_request(payload))
    channel.send_reply(info, rank, value, key)


def _run(owner: str, info: Any, run: Callable[[Any], Any], load: Callable[[], Any]) -> Any:
    try:
        return run(load())
    except Exception as exc:  # the driver raises it, naming this rank
        log.exception("%s: %s failed", owner, info.op)
        return Failure.of(exc)
