"""The demo job and the controller over Mooncake's TransferEngine (TCP) between the actors.

``wt demo --transport mooncake`` (here its function, ``run_cli``) runs the same
job as the simnic demo and is verified the same way: every engine byte equals
the reference layout of the trainers' weights, greedy generations equal the
trainer model's. After each update the actors are asked which transport their
NICs are: Mooncake, on every trainer and engine rank. Then a fleet over
Mooncake goes through ``add_replica`` (a new replica filled from a peer over
engine-to-engine Mooncake connections) and refuses fault injection, which only
simnic implements. Both on the demo's smallest shape (``configs/clusters/local_cpu_small.yaml``:
2 trainer ranks -> 1 replica x TP1, and a second replica added): the transport is the
subject, not the shape, which ``test_demo.py`` runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch

from actors import TransferConfig, WeightTransferController, launch_engines, launch_trainers
from actors.tools.demo import fleet as demo
from actors.tools.demo.fleet import run_cli
from actors.tools.testkit.engine_bytes import engine_mismatches
from actors.tools.testkit.hooks import FaultyTrainerActor
from weight_transfer.transport.mooncake.transport import load_engine_class

try:
    load_engine_class()
    MISSING = ""
except RuntimeError as exc:
    MISSING = str(exc)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.mooncake,
              pytest.mark.skipif(bool(MISSING), reason=MISSING)]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = CONFIGS / "clusters" / "local_cpu_small.yaml"


@pytest.fixture(scope="module")
def local_ray(ray_job):  # a Ray job of its own on the shared cluster (on LOCAL_NODE_IP)
    yield


def test_wt_demo_over_mooncake_is_byte_exact_and_generates_the_trainers_tokens(
        tmp_path, local_ray, monkeypatch):
    kinds = []
    real = demo.run_cycles

    def spy(fleet, console, after_update=None, **kwargs):
        def hook(fleet, version):
            actors = [*fleet.trainers, *(a for r in fleet.replicas.values() for a in r)]
            kinds.append(ray.get([a.wt_transport.remote() for a in actors]))
        return real(fleet, console, hook, **kwargs)

    monkeypatch.setattr(demo, "run_cycles", spy)
    out = tmp_path / "demo.json"
    rc = run_cli(config=Path("configs/runs/demo.yaml"), model=None, cluster=SMALL, fp8=None,
                 updates=2, json_path=out, corrupt_version=None, transport="mooncake")
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    assert doc["verified"] is True and [u["version"] for u in doc["updates"]] == [1, 2]
    for u in doc["updates"]:
        assert u["verified"] is True and u["problems"] == []
        assert u["checks"]["bytes"] is True and u["checks"]["generations"] is True
        assert u["checks"]["tensors"] == 15  # 1 engine rank, 15 tensors
        assert u["bytes"] == doc["plan"]["bytes"] > 0
        assert u["checks"]["weights_version"] == {"engine0": u["version"]}
    assert doc["updates"][1]["checks"]["tensors_changed_since_previous"] > 0
    assert kinds == [["mooncake"] * 3] * 2  # 2 trainer ranks + 1 engine rank, each update


def test_add_replica_over_mooncake_and_no_fault_injection(local_ray):
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    SMALL,
                                    transport="mooncake", transport_options={"protocol": "tcp"})
    trainers = launch_trainers(cfg, actor_cls=FaultyTrainerActor)  # wt_set_link
    replicas = launch_engines(cfg)
    ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
    summary = ctl.setup()
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(3))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    assert ctl.update(1).bytes == summary.bytes_total
    assert engine_mismatches(cfg.model, trainers, replicas) == []
    with pytest.raises(ray.exceptions.RayTaskError,
                       match=r"transport 'mooncake' cannot inject faults"):
        ray.get(trainers[0].wt_set_link.remote(False))
    (new,) = launch_engines(cfg, replicas=[1])
    assert ctl.add_replica(new) == "engine1"
    assert ctl.weights_version() == {"engine0": 1, "engine1": 1}
    assert engine_mismatches(cfg.model, trainers, [new]) == []  # copied from engine0 over Mooncake
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])
    assert ctl.update(2).bytes == ctl.summary.bytes_total == summary.bytes_total * 2
    assert engine_mismatches(cfg.model, trainers, [*replicas, new]) == []
    ctl.shutdown()
