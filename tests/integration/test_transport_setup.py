"""Setup refuses a transport that cannot reach a peer, on local Ray, before any byte moves.

Small actors (a ``TrainerMixin`` over one linear layer, an ``InferenceMixin``
over plain buffers) stand in for the ready-made ones: what is checked happens
before any plan exists. One engine says it runs on another host (hostname and
address; several Ray nodes of one host would share both): with simnic the
controller's ``setup()`` raises a ``ValueError`` naming the transport, the
actors and their hosts; no trainer opened a NIC and no engine byte changed.
The same actors connect with rdma-free transports that reach across hosts in
the unit tests (``tests/unit/test_handshake.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import ray.cloudpickle
import torch

from actors import TransferConfig, WeightTransferController
from actors.inference import InferenceMixin
from actors.trainer import TrainerMixin
from weight_transfer.transport.handshake import HostId
from weight_transfer.types import ShardSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# The actor classes below travel by value: Ray's workers cannot import a test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class BufferAdapter:
    def __init__(self, n: int) -> None:
        self.buffer = np.zeros(n, dtype=np.uint8)
        self.paused = False

    def region_buffers(self):
        return [(self.buffer, [("w", (self.buffer.size,), "uint8", 0)])]


@ray.remote(num_cpus=0)
class SmallTrainer(TrainerMixin):
    def __init__(self, rank: int, world: int) -> None:
        self.wt_attach(model=torch.nn.Linear(4, 4), rank=rank, world=world)


@ray.remote(num_cpus=0)
class SmallEngine(InferenceMixin):
    def __init__(self, replica: str, rank: int, host: HostId | None = None) -> None:
        self.adapter, self.host = BufferAdapter(4096), host
        self.wt_attach_engine(adapter=self.adapter, replica=replica, rank=rank,
                              shard=ShardSpec(tp_rank=rank, tp_size=2), nics=["inic0"])

    def wt_host(self) -> HostId:
        return self.host or super().wt_host()

    def touched(self) -> bool:
        return bool(self.adapter.buffer.any())


@pytest.fixture(scope="module")
def local_ray(ray_job):  # a Ray job of its own on the shared cluster
    yield


def test_simnic_to_an_engine_on_another_host_fails_at_setup_naming_them(local_ray):
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    CONFIGS / "clusters" / "vllm_cpu.yaml", setup_timeout_s=60)
    far = HostId(hostname="far-away", address="10.99.0.7")
    trainers = [SmallTrainer.remote(r, 2) for r in range(2)]
    engines = [SmallEngine.remote("engine0", 0), SmallEngine.remote("engine0", 1, far)]
    here = ray.get(trainers[0].wt_host.remote())
    ctl = WeightTransferController(trainers=trainers, engines=[engines], config=cfg)
    with pytest.raises(ValueError) as err:
        ctl.setup()
    msg = str(err.value)
    assert "TransferConfig.transport (trainer -> engine): transport 'simnic' cannot reach" in msg
    for rank in (0, 1):
        assert f"trainer{rank} on {here} -> engine0/tp1 on far-away (10.99.0.7)" in msg
    assert "engine0/tp0" not in msg  # on the trainers' host: reachable
    assert ctl.summary is None and ctl.scheduler is None  # nothing planned
    assert ray.get([t.wt_transport.remote() for t in trainers]) == [None, None]  # no NIC opened
    assert ray.get([e.touched.remote() for e in engines]) == [False, False]
