"""``wt demo --engine vllm --json -`` end to end: 2 FSDP2 trainer actors -> one real vLLM
replica (TP=1, owned by a Ray actor) of the tiny Qwen3-MoE (a dense MLP layer, MoE layers,
untied head), two updates. The run's own checks compare every byte our backend registered
with vLLM's own load_weights of the trainers' weights and vLLM's greedy tokens with the
trainers' model; this test asserts the JSON says so, with the reference demo's keys plus
``"engine": "vllm"`` and ``"oracle": "vllm.load_weights"``, and that vLLM's own logs
stayed at WARNING and above (no INFO or DEBUG line of vLLM's format; ``--verbose`` shows
them). One engine start.

The command runs as a Ray job of its own on the session's shared cluster (``RAY_ADDRESS``),
as a user's ``wt demo`` joins a running cluster: no Ray node of its own to start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from actors.tools.demo.run_config import ROOT

# Skipped where vLLM cannot be imported (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TOP_KEYS = {"run", "engine", "model", "cluster", "fp8", "setup_seconds", "total_seconds",
            "plan", "verified", "updates"}
# vLLM's log format: "(EngineCore pid=1) INFO 12-01 22:10:11 [core.py:93] ..."
VLLM_CHATTY_LINE = re.compile(r"\b(INFO|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[")
UPDATE_KEYS = {"version", "seconds", "bytes", "gb_per_s", "stages", "verified", "checks",
               "problems", "report"}


def test_wt_demo_with_vllm_verifies_every_update_against_vllms_load_weights(
        shared_ray_cluster, ray_job):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env["RAY_ADDRESS"] = shared_ray_cluster.address  # a job of its own there
    proc = subprocess.run(
        [sys.executable, "-m", "actors.tools.cli.main", "demo", "--engine", "vllm", "--json", "-",
         "--model", "configs/models/tiny_moe.yaml",
         "--cluster", "configs/clusters/vllm_cpu_tp1.yaml", "--updates", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    doc = json.loads(proc.stdout)
    chatty = [line for line in (proc.stdout + proc.stderr).splitlines()
              if VLLM_CHATTY_LINE.search(line)]
    assert not chatty, f"{len(chatty)} INFO/DEBUG lines of vLLM's, e.g.:\n" + "\n".join(chatty[:5])
    assert set(doc) == TOP_KEYS
    assert (doc["engine"], doc["model"], doc["cluster"], doc["fp8"]) == (
        "vllm", "tiny-qwen3-moe", "vllm_cpu_tp1", False)
    assert doc["verified"] is True and doc["plan"]["bytes"] > 0
    assert [u["version"] for u in doc["updates"]] == [1, 2]
    for u in doc["updates"]:
        checks = u["checks"]
        assert set(u) == UPDATE_KEYS and u["verified"] is True and u["problems"] == []
        assert checks["oracle"] == "vllm.load_weights"
        assert checks["bytes"] is True and checks["generations"] is True
        assert checks["weights_version"] == {"engine0": u["version"]}
        assert checks["tensors"] > 0 and len(checks["generation_sample"]) == 8
        assert u["bytes"] == doc["plan"]["bytes"]  # every planned byte, every update
    assert doc["updates"][1]["checks"]["tensors_changed_since_previous"] > 0
