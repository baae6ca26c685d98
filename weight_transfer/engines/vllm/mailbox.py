"""Requests to, and replies from, our backend inside vLLM's workers.

vLLM's worker calls (``init_weight_transfer_engine`` ...) carry a plain dict in
and return nothing. The driver therefore writes a request into a private
directory, calls ``init_weight_transfer_engine({"init_info": {"op": ...,
"mailbox": dir, "seq": n, "rank": r}})`` (it returns once every worker has
run it), and reads each worker's reply from the same directory. This works
with the offline ``LLM`` and with an HTTP server's
``/init_weight_transfer_engine`` route alike, needs neither a worker extension
nor vLLM's insecure (pickle) serialization, and keeps arbitrary objects out of
vLLM's msgpack channel. Files are pickles of our frozen dataclasses, written
and read by the same user on the same host (mode 0700 directory)::

    box = Mailbox.create()
    info = box.post("setup", SetupRequest(...), rank=-1)   # -> dict for init_info
    llm.init_weight_transfer_engine({"init_info": info})
    replies = box.replies(info, ranks=range(tp))             # one per TP rank
    # worker side:
    request = read_request(info); write_reply(info, rank, value)
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weight_transfer.types import TensorSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class SetupRequest:
    """Register the engine's memory with NICs of ``transport`` and describe it."""

    replica: str
    nics: tuple[tuple[str, ...], ...]  # per TP rank: the NICs it registers with
    transport: Any  # weight_transfer.transport.options.TransportSpec
    node: str = ""
    address: str = ""
    checkpoint: tuple[TensorSpec, ...] = ()  # empty: read from the model's safetensors
    # in_place: the trainers write the memory vLLM computes with (the engine paused);
    # shadow: a second copy, flipped in at finish_weight_update (engines.vllm.shadow)
    apply: str = "in_place"


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """A worker's exception, carried back pickled (``error``: empty if it does not
    pickle), with its type name, message and traceback as text."""

    kind: str
    message: str
    trace: str = field(default="", compare=False)
    error: bytes = field(default=b"", compare=False, repr=False)

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """The failure of ``exc``, raised in a worker (call it in the ``except`` block)."""
        try:
            error = pickle.dumps(exc)
        except Exception:  # an exception holding something that does not pickle
            error = b""
        return cls(kind=type(exc).__name__, message=str(exc), trace=traceback.format_exc(),
                   error=error)

    def exception(self, where: str) -> BaseException:
        """The worker's exception itself (its type and fields), noted with ``where`` and
        the worker's traceback; a RuntimeError naming it where it did not pickle."""
        try:
            err = pickle.loads(self.error) if self.error else None
        except Exception:  # its class is not importable here
            err = None
        if not isinstance(err, BaseException):
            err = RuntimeError(f"{where}: {self.kind}: {self.message}")
        err.add_note(f"{where}, in the vLLM worker:\n{self.trace}")
        return err


class Mailbox:
    """A private directory of numbered requests and per-rank replies."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._seq = 0

    @classmethod
    def create(cls) -> Mailbox:
        return cls(tempfile.mkdtemp(prefix="wt-vllm-"))

    def post(self, op: str, request: Any = None, *, rank: int = -1) -> dict[str, Any]:
        """Write ``request``; returns the ``init_info`` dict that names it."""
        self._seq += 1
        with open(self.path / f"{self._seq}.req", "wb") as f:
            pickle.dump(request, f)
        return {"op": op, "mailbox": str(self.path), "seq": self._seq, "rank": rank}

    def replies(self, info: dict[str, Any], ranks) -> list[Any]:
        """Each rank's reply to ``info``; a worker's failure is raised here (the exception the
        worker raised, see :meth:`Failure.exception`)."""
        out = []
        for r in ranks:
            path = self.path / f"{info['seq']}.rank{r}.rep"
            if not path.exists():
                raise RuntimeError(f"vLLM worker rank {r} sent no reply to {info['op']} "
                                   f"(is the backend '{info['op']}' op known to it?)")
            with open(path, "rb") as f:
                value = pickle.load(f)
            path.unlink()
            if isinstance(value, Failure):
                raise value.exception(f"vLLM worker rank {r}, {info['op']}")
            out.append(value)
        (self.path / f"{info['seq']}.req").unlink(missing_ok=True)
        return out

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def read_request(mailbox: str, seq: int) -> Any:
    with open(Path(mailbox) / f"{seq}.req", "rb") as f:
        return pickle.load(f)


def write_reply(mailbox: str, seq: int, rank: int, value: Any) -> None:
    path = Path(mailbox) / f"{seq}.rank{rank}.rep"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    tmp.rename(path)
