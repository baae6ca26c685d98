"""The demo's DeepSpeed trainer rank (``wt demo --trainer deepspeed``): OpenRLHF's shape.

The model config's transformers model (seeded as the FSDP2 trainers', bf16) wrapped by
``deepspeed.initialize`` with ZeRO-3 (the engine partitions it: every parameter's
``ds_tensor`` a flat 1/N slice), AdamW, and the library attached with one
``wt_attach(model=engine)`` as ``docs/embedding.md`` shows. The checks' oracle is
DeepSpeed's own consolidation (``deepspeed.zero.GatheredParameters``), not the plan.
On a machine without CUDA DeepSpeed runs with ``DS_ACCELERATOR=cpu`` over the gloo group
:meth:`init_rank` forms (set here when unset).
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from actors.ready.trainer import TrainerWorker
from actors.ready.trainer_model import _as_batch, rank_rows, sequence_loss

ZERO_STAGE = 3


def ds_config(lr: float, stage: int = ZERO_STAGE) -> dict[str, Any]:
    """OpenRLHF's kind of config: bf16, ZeRO ``stage``, AdamW (torch's, on CPU)."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}}}


class DeepSpeedTrainerWorker(TrainerWorker):
    """A trainer rank whose model a ``DeepSpeedEngine`` (ZeRO-3) trains."""

    def init_rank(self, host: str, port: int) -> str:
        """Join the gloo group, build the model and the DeepSpeed engine, attach it."""
        cfg = self.config
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.join_group(host, port)
        from weight_transfer.engines.reference.hf_model import build_hf_model

        model = build_hf_model(cfg.model, seed=self.demo.seed)  # before deepspeed: see module
        import deepspeed

        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(self.world))
        deepspeed.init_distributed("gloo")  # takes the default group joined above
        model.train()
        self.engine, *_ = deepspeed.initialize(model=model, config=ds_config(self.demo.lr),
                                               model_parameters=model.parameters())
        self.wt_attach(model=self.engine, rank=self.rank, world=self.world)
        return self.node_id()

    def train_step(self, tokens: Any, advantages: Any = None, prompt_len: int = 0) -> float:
        """One DeepSpeed step on this rank's share of ``tokens``; the mean loss over ranks."""
        ids = _as_batch(tokens, self.config.model.vocab_size)
        weights = None if advantages is None else torch.as_tensor(advantages,
                                                                  dtype=torch.float32)
        rows = rank_rows(ids.shape[0], rank=self.rank, world=self.world)
        with self.wt_step_fence(timeout_s=self.config.update_timeout_s):
            logits = self.engine(input_ids=ids[rows], use_cache=False).logits
            loss = sequence_loss(logits, ids[rows], prompt_len=prompt_len,
                                 weights=None if weights is None else weights[rows])
            self.engine.backward(loss)
            self.engine.step()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        return float(mean) / self.world

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's own consolidation of the current weights on rank 0 (a collective)."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            full = {n: p.data.detach().clone() for n, p in params.items()}
        return full if self.rank == 0 else None


DeepSpeedTrainerActor = ray.remote(DeepSpeedTrainerWorker)
