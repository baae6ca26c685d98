"""`wt bench pipeline` on a tiny model: both modes run, land the right bytes, JSON has the keys."""

import json
from pathlib import Path

import pytest

from scripts.bench_pipeline import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_pipeline_tiny(tmp_path):
    out = tmp_path / "bench.json"
    rc = run(ROOT / "configs/models/tiny_moe.yaml", ROOT / "configs/clusters/local_cpu.yaml",
             fp8=True, nic_gbps=2.0, watermark="16M", json_path=out)
    assert rc == 0
    data = json.loads(out.read_text())
    for mode in ("serial", "pipelined"):
        assert data[mode]["verified"] is True
        assert data[mode]["seconds"] > 0 and data[mode]["gbps"] > 0
    assert data["speedup"] > 0 and data["bytes"] > 0 and data["tasks"] > 0
