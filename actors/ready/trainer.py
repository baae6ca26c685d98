"""The ready-made trainer rank: an FSDP2 model built from a model config, AdamW, and the
:class:`~actors.trainer.TrainerMixin` (``TrainerActor`` is it as a Ray actor).

A user with trainer actors of their own adds the mixin to them instead; see
docs/embedding.md.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from actors.config import DemoActorConfig, TransferConfig
from actors.groups import GroupMember, connect_store, join_gloo_group
from actors.ready.trainer_model import (
    build_sharded_model,
    gather_full_state,
    make_optimizer,
    train_step,
)
from actors.trainer import TrainerMixin


class TrainerWorker(TrainerMixin, GroupMember):
    """The ready-made trainer rank (``TrainerActor`` is this class as a Ray actor)."""

    def __init__(self, config: TransferConfig, rank: int, *,
                 demo: DemoActorConfig = DemoActorConfig()) -> None:
        self.config, self.rank, self.demo = config, rank, demo
        self.world = config.cluster.trainer_world
        if not 0 <= rank < self.world:
            raise ValueError(f"trainer rank {rank} outside [0, {self.world})")
        self._store = None
        self._ref: torch.nn.Module | None = None

    def join_group(self, host: str, port: int) -> None:
        """Join the trainers' gloo group through the launcher's store at ``host:port``."""
        if self._store is None:
            self._store = connect_store(host, port, timeout_s=self.config.setup_timeout_s)
        join_gloo_group(self._store, rank=self.rank, world=self.world,
                        timeout_s=self.config.setup_timeout_s)

    def init_rank(self, host: str, port: int) -> str:
        """Join the gloo group, build and shard the model; returns this rank's node id."""
        cfg = self.config
        self.join_group(host, port)
        seed = self.demo.seed
        torch.manual_seed(seed + 1000 + self.rank)  # per-rank randomness stays reproducible
        model = build_sharded_model(cfg.model, cfg.cluster, seed=seed)
        self.optimizer = make_optimizer(model, lr=self.demo.lr)
        self.wt_attach(model=model, rank=self.rank, world=self.world)
        return self.node_id()

    def train_step(self, tokens: Any, advantages: Any = None, prompt_len: int = 0) -> float:
        """One AdamW step (all ranks call with the same batch; each trains on its share);
        it waits while an update reads the parameters (``wt_step_fence``)."""
        with self.wt_step_fence(timeout_s=self.config.update_timeout_s):
            return train_step(self._wt_require_model(), self.optimizer, tokens,
                              rank=self.rank, world=self.world, advantages=advantages,
                              prompt_len=prompt_len)

    def _reference_model(self) -> torch.nn.Module | None:
        """Full weights (:meth:`full_state_dict`) in a plain model on rank 0 (a collective:
        every rank calls)."""
        full = self.full_state_dict()
        if full is None:
            return None
        if self._ref is None:
            from weight_transfer.engines.reference.hf_model import (
                build_hf_model,  # transformers, on first use
            )

            self._ref = build_hf_model(self.config.model, seed=self.demo.seed)
        self._ref.load_state_dict(full)
        return self._ref

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The trainer's current full weights on rank 0 (for verification only)."""
        full = gather_full_state(self._wt_require_model())
        return full if self.rank == 0 else None

    def reference_generate(self, prompts: list[list[int]], max_new_tokens: int):
        """Greedy generations of the trainer's current weights (rank 0 answers)."""
        from weight_transfer.engines.reference.hf_model import (
            greedy_generate,  # transformers, on first use
        )

        ref = self._reference_model()
        return None if ref is None else greedy_generate(ref, prompts, max_new_tokens)

    def reference_logits(self, ids: Any) -> torch.Tensor | None:
        """Float32 logits [B, T, vocab] of the trainer's current weights (rank 0 answers)."""
        from weight_transfer.engines.reference.hf_model import (
            float_logits,  # transformers, on first use
        )

        ref = self._reference_model()
        return None if ref is None else float_logits(ref, torch.as_tensor(ids, dtype=torch.long))


TrainerActor = ray.remote(TrainerWorker)
