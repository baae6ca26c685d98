"""A streaming client of a vLLM server: completions with the weight versions that sampled them.

vLLM's ``POST /inference/v1/generate`` (``vllm serve --enable-scale-out``)
takes token ids and full ``SamplingParams`` (as a dict) and, with
``"stream": true``, sends server-sent events; the final chunk of a choice
carries ``weight_versions``: spans ``[start, end)`` of output-token indexes and
the weight version that sampled them. A request that was in flight across an
update (pause mode ``keep``) has two spans::

    with StreamingClient(url, prompts, {"max_tokens": 32, "temperature": 1.0}) as client:
        ...                               # updates happen; requests keep streaming
        done = client.take()              # completions finished since the last take()
        versions_seen(done)               # ["3", "4"]

:func:`stream_generate` is one such request, for a rollout worker's own loop.
Standard library HTTP only.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """Output tokens ``[start, end)`` were sampled by weights ``version``."""

    version: str
    start: int
    end: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """One finished choice of a streamed request.

    ``prompt``: the prompt's token ids; ``token_ids``: the output tokens; ``spans``: which
    weight version sampled which output tokens (vLLM's ``weight_versions``: contiguous,
    in order, covering every token; ``"default"`` for the weights the server started with);
    ``finish_reason``: vLLM's (``"length"``, ``"stop"``, ``"abort"`` for a request aborted by
    an update in pause mode ``abort``); ``logprobs``: of the sampled tokens, where asked for;
    ``sent_at``: when the request was sent and ``token_times``: when each output token
    arrived, both ``time.monotonic()`` seconds of this process (a token is sampled before it
    arrives, so a token that arrived before an update began cannot carry its version).
    """

    prompt: tuple[int, ...]
    token_ids: tuple[int, ...]
    spans: tuple[Span, ...]
    finish_reason: str | None
    logprobs: tuple[float, ...] = ()
    sent_at: float = 0.0
    token_times: tuple[float, ...] = ()

    @property
    def versions(self) -> tuple[str, ...]:
        return tuple(s.version for s in self.spans)

    def version_of(self, index: int) -> str:
        """The weight version that sampled output token ``index``; IndexError outside."""
        for span in self.spans:
            if span.start <= index < span.end:
                return span.version
        raise IndexError(f"output token {index} is in no span of {self.spans}")


def _events(resp: Any) -> Iterator[dict[str, Any]]:
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def stream_generate(url: str, prompt: Sequence[int], sampling_params: dict[str, Any], *,
                    timeout_s: float = 600.0,
                    on_tokens: Callable[[int], None] | None = None) -> list[Completion]:
    """One streamed request: its finished choices (``n`` of them). ``on_tokens`` is called
    with the number of output tokens received so far (all choices) after each that brings
    some."""
    body = {"token_ids": list(prompt), "stream": True,
            "sampling_params": {"detokenize": False, **sampling_params}}
    req = urllib.request.Request(url.rstrip("/") + "/inference/v1/generate",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    tokens: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    logprobs: dict[int, list[float]] = {}
    out: list[Completion] = []
    sent_at = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for event in _events(resp):
            arrived = time.monotonic()
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            for ch in event["choices"]:
                i = ch["index"]
                new = ch.get("token_ids") or ()
                tokens.setdefault(i, []).extend(new)
                times.setdefault(i, []).extend([arrived] * len(new))
                content = (ch.get("logprobs") or {}).get("content") or ()
                logprobs.setdefault(i, []).extend(c["logprob"] for c in content)
                if new and on_tokens is not None:
                    on_tokens(sum(map(len, tokens.values())))
                if ch.get("finish_reason") is not None:
                    spans = tuple(Span(version=s["version"], start=s["start"], end=s["end"])
                                  for s in ch.get("weight_versions") or ())
                    out.append(Completion(prompt=tuple(prompt), token_ids=tuple(tokens[i]),
                                          spans=spans, finish_reason=ch["finish_reason"],
                                          logprobs=tuple(logprobs[i]), sent_at=sent_at,
                                          token_times=tuple(times[i])))
    return out


def versions_seen(completions: Sequence[Completion]) -> list[str]:
    """The distinct weight versions that sampled any token of ``completions``, sorted."""
    return sorted({v for c in completions for v in c.versions},
                  key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v))


class StreamingClient:
    """``concurrency`` threads sending streamed requests, round robin over ``prompts``,
    until :meth:`close`; finished completions are kept for :meth:`take`."""

    def __init__(self, url: str, prompts: Sequence[Sequence[int]],
                 sampling_params: dict[str, Any], *, concurrency: int = 2) -> None:
        if not prompts:
            raise ValueError("StreamingClient: no prompts")
        self.url, self.params = url, dict(sampling_params)
        self._prompts = itertools.cycle([tuple(p) for p in prompts])
        self._done: list[Completion] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors: list[str] = []
        self.requests = 0
        self.last_taken: list[Completion] = []
        self._streamed = [0] * concurrency  # output tokens of each thread's request in flight
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"wt-stream-{i}",
                                          daemon=True) for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def _loop(self, index: int) -> None:
        def streamed(n: int) -> None:
            self._streamed[index] = n

        while not self._stop.is_set():
            with self._lock:
                prompt = next(self._prompts)
                self.requests += 1
            try:
                done = stream_generate(self.url, prompt, self.params, on_tokens=streamed)
            except Exception as exc:  # kept for the report; the loop goes on
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    self._streamed[index] = 0
                if self._stop.wait(0.5):
                    return
                continue
            with self._lock:
                self._done.extend(done)
                self._streamed[index] = 0

    def wait_mid_stream(self, *, at_most: int, timeout_s: float = 120.0) -> int:
        """Block until a request in flight has sampled between 1 and ``at_most`` output
        tokens (it is streaming and has more to come, for a caller that wants an update to
        land in the middle of one); its count. TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                mid = [n for n in self._streamed if 1 <= n <= at_most]
            if mid:
                return mid[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}: no request in flight with 1 to {at_most} "
                                   f"output tokens within {timeout_s:g} s (errors: "
                                   f"{self.errors[-3:]})")
            time.sleep(0.002)

    def take(self) -> list[Completion]:
        """The completions finished since the previous call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait_for_version(self, version: Any, *, timeout_s: float = 120.0) -> list[Completion]:
        """The completions finished since the previous take, once one sampled (in part) by
        ``version`` is among them; TimeoutError naming the versions seen otherwise (the
        completions stay taken: :attr:`last_taken`)."""
        want, done = str(version), []
        deadline = time.monotonic() + timeout_s
        while True:
            done += self.take()
            self.last_taken = done
            if any(want in c.versions for c in done):
                return done
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}: no completion sampled by version {want} "
                                   f"within {timeout_s:g} s (seen: {versions_seen(done)}; "
                                   f"errors: {self.errors[-3:]})")
            time.sleep(0.1)

    def close(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    def __enter__(self) -> StreamingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
