"""Set-up and oracles shared by the vLLM integration modules (test code, not library code).

The modules that drive a vLLM replica through the controller build the same pieces:
tiny_llama in float32 (vLLM on CPU runs float32, which holds the trainers' values
exactly) on a vllm-cpu cluster file, trainers, one engine per replica from a random
checkpoint, and a controller; after an update they save the trainers' weights as a
Hugging Face checkpoint and compare every byte our backend registered with vLLM's own
``load_weights`` of it, in the workers::

    cfg = tiny_llama_config("vllm_cpu.yaml", update_timeout_s=120)
    with vllm_fleet(cfg, root) as fleet:           # the controller is not set up yet
        fleet.ctl.setup()
        train_step(fleet.trainers, seed=1)
        fleet.ctl.update(1)
        model, path = trainer_checkpoint(cfg, fleet.trainers, root, 1)
        assert_registered_equal(fleet.replicas.owners[0], path, tp=2)

Each module still starts its own engine: a module's actors die with its Ray driver
(``ray_job`` in conftest.py), and the modules differ in cluster (TP 1 or 2) and in
the controller's mode (in place, shadow, delta), which an engine is set up for once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from actors.tools.testkit.vllm_oracle import (
    compare_to_oracle,
    oracle_load,
    registered_tensors,
    save_checkpoint,
)
from weight_transfer.engines.vllm.shm import SHM_DIR

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LLAMA = CONFIGS / "models" / "tiny_llama.yaml"
START_SEED = 11  # the random checkpoint every engine starts from
# The oracle runs in the workers as a callable sent by collective_rpc.
ORACLE_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def tiny_llama_config(cluster: str, **overrides: Any) -> Any:
    """tiny_llama in float32 on ``configs/clusters/<cluster>`` (``overrides``: config fields)."""
    from actors import TransferConfig

    cfg = TransferConfig.from_files(LLAMA, CONFIGS / "clusters" / cluster, **overrides)
    return cfg.replace(model=cfg.model.model_copy(update={"torch_dtype": "float32"}))


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmFleet:
    """What :func:`vllm_fleet` started: trainers, vLLM replicas, their controller."""

    trainers: Any
    replicas: Any
    ctl: Any
    start_model: Any  # the Hugging Face model every engine started from


@contextmanager
def vllm_fleet(cfg: Any, root: Path) -> Iterator[VllmFleet]:
    """Trainers, one vLLM engine per replica (from a random checkpoint saved under
    ``root``) and a controller, not set up; all shut down on exit."""
    from actors import WeightTransferController, launch_trainers
    from actors.vllm.engine import launch_vllm_engines

    start_model, start = save_checkpoint(LLAMA, seed=START_SEED, root=root)
    segments: list[str] = []
    with (launch_trainers(cfg) as trainers,
          launch_vllm_engines(cfg, str(start), env=ORACLE_ENV) as replicas):
        ctl = WeightTransferController(trainers=trainers, engines=replicas, config=cfg)
        try:
            yield VllmFleet(trainers=trainers, replicas=replicas, ctl=ctl,
                            start_model=start_model)
        finally:
            ctl.shutdown()
            segments = engine_shm(replicas)
    # No leaked shared memory: what the engines' processes mapped (at TP2, vLLM's broadcast
    # queue) is gone once the handle closed them. Only this fleet's segments are looked at:
    # other modules' engines run beside it.
    left = [name for name in segments if (SHM_DIR / name).exists()]
    assert not left, f"closed vLLM engines left /dev/shm segments {left} of {segments}"


def engine_shm(replicas: Any) -> list[str]:
    """The /dev/shm segments the processes of each replica's engine map now."""
    from weight_transfer.engines.vllm.shm import engine_segments

    return sorted({name for owner in replicas.owners for name in ray.get(
        owner.__ray_call__.remote(lambda self: sorted(engine_segments())), timeout=60)})


def train_step(trainers: Any, seed: int) -> None:
    """One training step on every trainer rank, on the same tokens (seeded by ``seed``)."""
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(seed))
    ray.get([t.train_step.remote(tokens.tolist()) for t in trainers])


def trainer_checkpoint(cfg: Any, trainers: Any, root: Path, version: Any) -> tuple[Any, Path]:
    """The trainers' current weights as a float32 Hugging Face model, saved under ``root``
    as ``trainer-v<version>``: (model, path)."""
    from weight_transfer.engines.reference.hf_model import build_hf_model

    state = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    model = build_hf_model(cfg.model, seed=0, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    path = Path(root) / f"trainer-v{version}"
    model.save_pretrained(path)
    return model, path


def assert_registered_equal(owner: Any, path: Path, *, tp: int) -> None:
    """Every byte registered in each of the ``tp`` workers equals vLLM's own load_weights
    of the checkpoint ``path``."""
    got = ray.get(owner.collective_rpc.remote(registered_tensors))
    want = ray.get(owner.collective_rpc.remote(oracle_load, (str(path),)))
    for rank in range(tp):
        assert compare_to_oracle(got[rank], want[rank]) == [], f"tp rank {rank}"


def nudge(trainer: Any) -> int:
    """Change a few elements of the rank's shard of three parameters (no optimizer): vLLM
    on CPU runs float32, where an AdamW step changes nearly every element. Run in the
    trainer actors (``t.__ray_call__.remote(nudge)``); returns the elements changed."""
    n = 0
    with torch.no_grad():
        for _name, p in list(trainer._wt_require_model().named_parameters())[1:4]:
            local = p.to_local() if hasattr(p, "to_local") else p
            local.view(-1)[: 7] += 0.125
            n += 7
    return n


# The actors cannot import this module (tests/ is not installed): pickled by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def engine_processes(actor: Any) -> tuple[list[int], list[str]]:
    """(pids, /dev/shm segments) of the processes under a user's actor: its engine's."""
    from weight_transfer.engines.vllm.shm import descendants, mapped_segments

    def look(self):
        import os

        pids = descendants(os.getpid())
        return pids, sorted(mapped_segments(pids))

    return ray.get(actor.__ray_call__.remote(look), timeout=60)


def assert_engine_gone(pids: list[int], segments: list[str], timeout_s: float = 120.0) -> None:
    """A killed user's actor: its engine's processes exit (vLLM's watch their parent) and
    none of their segments is left (weight_transfer.engines.vllm.shm.unlink_at_exit);
    polled: a process takes a moment to see its parent die."""
    from weight_transfer.engines.vllm.shm import live_pids

    deadline = time.monotonic() + timeout_s
    while True:
        alive = sorted(set(pids) & set(live_pids()))
        left = [name for name in segments if (SHM_DIR / name).exists()]
        if (not alive and not left) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not alive, f"the user's engine processes {alive} outlived its actor"
    assert not left, f"the user's engine left /dev/shm segments {left}"
