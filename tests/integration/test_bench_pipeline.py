"""`wt bench pipeline` on a tiny model: both modes land the right bytes, the JSON is complete.

Nothing here asserts on speed (the machines are shared and noisy): the
benchmark guarantees that both runs wrote every engine byte the reference
loader expects, and that its report is consistent with the plan it ran.
"""

import json
from pathlib import Path

import pytest

from actors.tools.bench.pipeline import run
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.model.models import load_model_config

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs/models/tiny_moe.yaml"
CLUSTER = ROOT / "configs/clusters/local_cpu.yaml"
MODES = ("serial", "pipelined")


def expected_plan_size(fp8: bool) -> tuple[int, int]:
    """(engine bytes, plan tasks) of the same configs, computed without the benchmark."""
    cfg, cluster = load_model_config(MODEL), load_cluster_config(CLUSTER)
    engines = engine_metas_from_config(cfg, cluster, fp8=fp8)
    plan = compute_plan(trainer_meta_from_config(cfg, cluster), engines, cluster,
                        model=cfg, fp8=fp8)
    engine_bytes = sum(t.nbytes for e in engines for t in e.tensors)
    assert plan.bytes_total == engine_bytes  # every engine byte is written exactly once
    return engine_bytes, plan.num_tasks


@pytest.mark.slow
def test_bench_pipeline_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = run(MODEL, CLUSTER, fp8=True, nic_gbps=2.0, watermark="16M", json_path=out,
             repeats=2, bucket_bytes="1M")
    report = capsys.readouterr().out
    assert rc == 0, report
    data = json.loads(out.read_text())
    assert set(data) == {*MODES, "speedup", "bytes", "tasks", "link_bound_s", "binding",
                         "nic_gbps", "repeats", "bucket_bytes"}
    assert (data["repeats"], data["bucket_bytes"], data["nic_gbps"]) == (2, 1 << 20, 2.0)

    engine_bytes, tasks = expected_plan_size(fp8=True)
    assert (data["bytes"], data["tasks"]) == (engine_bytes, tasks)
    assert tasks > 0
    for mode in MODES:
        r = data[mode]
        assert set(r) == {"seconds", "gbps", "verified", "runs", "prepare_s"}, mode
        # sha256 of every engine region equals the reference loader's layout
        assert r["verified"] is True, f"{mode} run wrote wrong engine bytes"
        assert len(r["runs"]) == 2 and r["seconds"] == pytest.approx(sum(r["runs"]) / 2), mode
        assert 0 < r["prepare_s"] < max(r["runs"]), mode
        assert r["gbps"] == pytest.approx(engine_bytes / r["seconds"] / 1e9), mode
    assert data["speedup"] == pytest.approx(
        data["serial"]["seconds"] / data["pipelined"]["seconds"])
    # the link bound is the busiest trainer NIC's planned bytes at the cap
    cfg, cluster = load_model_config(MODEL), load_cluster_config(CLUSTER)
    engines = engine_metas_from_config(cfg, cluster, fp8=True)
    plan = compute_plan(trainer_meta_from_config(cfg, cluster), engines, cluster,
                        model=cfg, fp8=True)
    busiest = max(sum(t.nbytes for t in plan.trainer_plan(r).tasks)
                  for r in range(len(plan.trainer_ranks)))
    assert data["link_bound_s"] == pytest.approx(busiest / 2e9)
    assert data["binding"] == ("link" if busiest / 2e9 >= data["serial"]["prepare_s"] else "cpu")

    assert f"{engine_bytes / 1e6:.1f} MB, {tasks} tasks" in " ".join(report.split())
    for mode in MODES:
        row = next((line for line in report.splitlines() if mode in line), "")
        assert "True" in row and "False" not in row, f"{mode} row of the report: {row!r}"
