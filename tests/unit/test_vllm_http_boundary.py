"""HttpLink's step boundary and generation under an adapter, against a stand-in server that records
the routes called (loopback, standard library, no vLLM): ``at_step_boundary`` pauses in mode
``keep``, runs the function, resets the prefix cache and resumes, also when the function
raises, and is refused while a full-weight update is open; ``generate`` names the adapter as
``"model"`` and ``generate_tagged`` reads the server's weight versions; ``on_step`` (the adapter
version per token) is refused over HTTP."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from weight_transfer.engines.vllm.channel import new_key
from weight_transfer.engines.vllm.http_link import HttpLink


class _Server:
    """A stand-in vLLM server: every route answers; ``calls`` records (method, path, body)."""

    def __enter__(self):
        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size) or b"null")
                calls.append((self.command, self.path, body))
                answer = {"world_size": 1, "success": True}
                if self.path.startswith("/inference/v1/generate"):
                    answer = {"choices": [{"token_ids": [4, 5, 6], "weight_versions": [
                        {"version": "3", "start": 0, "end": 3}]}]}
                text = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.link = HttpLink(f"http://127.0.0.1:{self.server.server_address[1]}", key=new_key(),
                             pause_mode="abort")
        calls.clear()
        return self

    def routes(self):
        return [path for _, path, _ in self.calls]

    def __exit__(self, *exc):
        self.link.box.close()
        self.server.shutdown()
        self.server.server_close()


def test_the_boundary_pauses_in_keep_mode_and_always_resumes():
    with _Server() as srv:
        ran = []
        assert srv.link.at_step_boundary(lambda: ran.append(srv.link.gate.paused), 7) >= 0
        assert ran == [True] and not srv.link.gate.paused
        assert srv.routes() == ["/pause?mode=keep", "/reset_prefix_cache?reset_running_"
                                "requests=true", "/resume"]  # keep, whatever pause_mode
        srv.calls.clear()

        def fails():
            raise ValueError("lora_flip failed")

        with pytest.raises(ValueError, match="lora_flip failed"):
            srv.link.at_step_boundary(fails)
        assert srv.routes() == ["/pause?mode=keep", "/resume"] and not srv.link.gate.paused


def test_the_boundary_is_refused_while_a_full_weight_update_is_open():
    with _Server() as srv:
        srv.link.pause()
        srv.calls.clear()
        with pytest.raises(ValueError, match="full-weight update is in progress"):
            srv.link.at_step_boundary(lambda: None)
        assert srv.calls == []


def test_generation_names_the_adapter_and_reads_the_servers_versions():
    with _Server() as srv:
        tagged = srv.link.generate_tagged([[1, 2]], 3, lora_request="policy")
        assert [g.versions for g in tagged] == [(3,)]
        request = SimpleNamespace(lora_name="policy", lora_int_id=1)  # a LoRARequest's name
        assert srv.link.generate([[1, 2], [3]], 3, lora_request=request) == [[4, 5, 6]] * 2
        assert srv.link.generate([[1, 2]], 3) == [[4, 5, 6]]
        models = [body.get("model") for _, path, body in srv.calls]
        assert models == ["policy", "policy", "policy", None]
        with pytest.raises(ValueError, match="no engine-step timestamps"):
            srv.link.generate_tagged([[1, 2]], 3, on_step=lambda i, n, t: None)
