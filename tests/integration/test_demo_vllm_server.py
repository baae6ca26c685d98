"""``wt demo --engine vllm-server --json -`` end to end: 2 FSDP2 trainer actors -> one
``vllm serve`` server (tiny Llama, TP1, 127.0.0.1) driven through vLLM's RL HTTP routes while
a client streams sampled requests, two updates. The run's own checks compare every byte our
backend registered with vLLM's own load_weights of the trainers' weights (in the server's
worker) and vLLM's greedy tokens with the trainers' model; this test asserts the JSON says
so, with ``"engine": "vllm-server"`` and, per update, the streaming client's
``versions_seen`` holding that version. One server start.

The command runs as a Ray job of its own on the session's shared cluster (``RAY_ADDRESS``),
as a user's ``wt demo`` joins a running cluster: no Ray node of its own to start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actors.tools.demo.run_config import ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_wt_demo_with_a_vllm_server_reports_the_versions_a_streaming_client_saw(
        shared_ray_cluster, ray_job):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env["RAY_ADDRESS"] = shared_ray_cluster.address  # a job of its own there
    proc = subprocess.run(
        [sys.executable, "-m", "actors.tools.cli.main", "demo", "--engine", "vllm-server",
         "--json", "-", "--updates", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["engine"] == "vllm-server" and report["verified"] is True
    assert [u["version"] for u in report["updates"]] == [1, 2]
    for u in report["updates"]:
        checks = u["checks"]
        assert u["verified"] and checks["bytes"] and checks["generations"], u["problems"]
        assert checks["oracle"] == "vllm.load_weights" and checks["tensors"] == 15
        assert str(u["version"]) in checks["versions_seen"] and checks["streamed"] > 0
        assert checks["stream_errors"] == 0
        assert checks["weights_version"] == {"engine0": u["version"]}
