"""docs/embedding.md's RL-loop block runs as written (from the repository root, one step):
the ready-made trainers and reference engines of configs/clusters/local_cpu.yaml, setup once,
an update, every replica at the version, the handles closed."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.tools.testkit.doc_snippets import run_snippet

pytestmark = [pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_rl_loop_block_runs_as_written(ray_job, monkeypatch):
    monkeypatch.chdir(ROOT)  # the block names configs/ relative to the repository
    ns = run_snippet(ROOT / "docs" / "embedding.md", "rl-loop", {"steps": 1})
    assert ns["report"].version == 1 and ns["report"].bytes == ns["ctl"].summary.bytes_total
    assert ns["replicas"].closed and ns["trainers"].closed
