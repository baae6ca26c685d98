"""`wt bench staging` on a tiny model: both modes land the right bytes, the JSON is complete.

Nothing here asserts on speed: only that every update of both modes ran and
the engine regions equal the reference loader's after the last one.
"""

import json
from pathlib import Path

from actors.tools.bench.staging import MODES, run

ROOT = Path(__file__).resolve().parents[2]


def test_bench_staging_tiny(tmp_path, capsys):
    out = tmp_path / "staging.json"
    rc = run(ROOT / "configs/models/tiny_moe.yaml", ROOT / "configs/clusters/local_cpu.yaml",
             fp8=True, nic_gbps=None, watermark="16M", updates=3, json_path=out)
    report = capsys.readouterr().out
    assert rc == 0, report
    data = json.loads(out.read_text())
    assert set(data) == {*MODES, "bytes", "tasks", "updates"}
    assert data["updates"] == 3 and data["bytes"] > 0
    for mode in MODES:
        r = data[mode]
        assert r["verified"] is True, mode
        assert len(r["update_seconds"]) == 3 and min(r["update_seconds"]) > 0
        assert r["first_seconds"] == r["update_seconds"][0]
    assert "fresh / staged" in report
