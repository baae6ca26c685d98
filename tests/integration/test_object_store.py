"""What one update puts into Ray's object store does not grow with the model.

The same topology (2 FSDP2 trainer ranks -> 1 replica x TP2) runs tiny_llama and a
model four times its size (hidden, heads, MLP and vocab doubled). The controller
counts the pickled size of every argument and result of every Ray call an update
makes (``UpdateReport.control_bytes``): "go" with the version, pause/resume, the
ranks' constant-size reports. Weights go through simulated NICs only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
import yaml

from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
from scheduling import load_cluster_config
from weight_transfer.model.models import load_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ray_local(ray_job):  # a Ray job of its own on the shared cluster
    yield


def small_cluster(tmp_path: Path) -> Path:
    data = yaml.safe_load((CONFIGS / "clusters" / "local_cpu.yaml").read_text())
    data["trainer"].update(nodes=1, gpus_per_node=2, nics_per_node=2, expert_parallel=1)
    data["inference"].update(replicas=1)
    path = tmp_path / "two_by_one.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_updates(cfg: TransferConfig, versions=(1, 2)):
    trainers, replicas = launch_trainers(cfg), launch_engines(cfg)
    try:
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        summary = ctl.setup()
        reports = []
        for v in versions:
            tokens = torch.randint(0, cfg.model.vocab_size, (2, 16),
                                   generator=torch.Generator().manual_seed(v))
            ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
            reports.append(ctl.update(v))
        ctl.shutdown()
        return summary, reports
    finally:
        for actor in [*trainers, *(a for rep in replicas for a in rep)]:
            ray.kill(actor)


def test_control_bytes_do_not_grow_with_model_size(ray_local, tmp_path):
    cluster = small_cluster(tmp_path)
    small_model = load_model_config(CONFIGS / "models" / "tiny_llama.yaml")
    big_model = small_model.model_copy(update={
        "name": "tiny-llama-x4", "hidden_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 1024, "vocab_size": 2000})
    runs = {}
    for label, model in (("small", small_model), ("big", big_model)):
        cfg = TransferConfig(model=model, cluster=load_cluster_config(cluster))
        runs[label] = run_updates(cfg)
    (small_plan, small), (big_plan, big) = runs["small"], runs["big"]
    assert big_plan.bytes_total >= 3.9 * small_plan.bytes_total  # the model is 4x larger
    for s, b in zip(small, big, strict=True):
        assert s.bytes == small_plan.bytes_total and b.bytes == big_plan.bytes_total
        assert s.control_calls == b.control_calls  # 2 trainers "go", 2 pauses, 2 resumes
        assert b.control_bytes <= 1.05 * s.control_bytes + 64, (s.control_bytes, b.control_bytes)
        assert b.control_bytes < big_plan.bytes_total / 1000  # kilobytes vs megabytes
    print(f"control bytes per update: small {small[-1].control_bytes} B for "
          f"{small_plan.bytes_total} B of weights; big {big[-1].control_bytes} B for "
          f"{big_plan.bytes_total} B")
