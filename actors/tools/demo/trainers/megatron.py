"""The demo's Megatron-core trainer rank (``wt demo --trainer megatron``): slime's shape.

A ``GPTModel`` of the model config (megatron-core's local layer spec, bf16, the
vocabulary padded to a multiple of 128 x TP as Megatron-LM pads it, seeded alike on every
rank so that each keeps its slice of the same weights) at TP 2 when the ranks and the
query groups allow (else 1), the other ranks data parallel (their gradients averaged
over Megatron's data-parallel group), AdamW, and the library attached with one
``wt_attach(model=model)`` as ``docs/embedding.md`` shows. The checks' oracle is the
plain conversion of the weights Megatron holds, gathered over TP
(:mod:`actors.tools.testkit.megatron_hf`), independent of the plan. On a machine without
CUDA Megatron's CUDA assumptions are side-stepped by the test kit
(:mod:`actors.tools.testkit.megatron_cpu`), in this process only.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from actors.ready.trainer import TrainerWorker
from actors.ready.trainer_model import _as_batch, rank_rows

TP = 2  # slime's small-model shape: TP 2, the rest data parallel
VOCAB_MULTIPLE = 128  # Megatron-LM's make-vocab-size-divisible-by


def megatron_tp(world: int, model_cfg: Any) -> int:
    """:data:`TP` where it divides the ranks, the heads and the query groups, else 1."""
    ok = all(n % TP == 0 for n in (world, model_cfg.num_attention_heads, model_cfg.kv_heads))
    return TP if ok else 1


def padded_vocab(vocab: int, tp: int) -> int:
    step = VOCAB_MULTIPLE * tp
    return -(-vocab // step) * step


class MegatronTrainerWorker(TrainerWorker):
    """A trainer rank whose model is a Megatron-core ``GPTModel`` (TP x DP, PP 1)."""

    def init_rank(self, host: str, port: int) -> str:
        """Join the gloo group, form Megatron's groups, build the model, attach it."""
        from megatron.core import parallel_state as ps

        from actors.tools.testkit.megatron_cpu import gpt_model, patch_for_cpu

        cfg = self.config
        self.join_group(host, port)
        patch_for_cpu()
        tp = megatron_tp(self.world, cfg.model)
        ps.initialize_model_parallel(tp, 1)
        torch.manual_seed(self.demo.seed)  # every rank cuts its shard from the same weights
        self.model = gpt_model(cfg.model, vocab_rows=padded_vocab(cfg.model.vocab_size, tp))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.demo.lr)
        self.wt_attach(model=self.model, rank=self.rank, world=self.world)
        return self.node_id()

    def train_step(self, tokens: Any, advantages: Any = None, prompt_len: int = 0) -> float:
        """One AdamW step: each data-parallel rank on its share of ``tokens`` (its TP ranks
        on the same rows), the gradients averaged over data parallel; the mean loss."""
        from megatron.core import parallel_state as ps

        from actors.tools.testkit.megatron_cpu import causal_mask, positions

        ids = _as_batch(tokens, self.config.model.vocab_size)
        dp, group = ps.get_data_parallel_world_size(), ps.get_data_parallel_group()
        rows = rank_rows(ids.shape[0], rank=ps.get_data_parallel_rank(), world=dp)
        x = ids[rows]
        with self.wt_step_fence(timeout_s=self.config.update_timeout_s):
            per_token = self.model(x, positions(x), causal_mask(x),
                                   labels=torch.roll(x, -1, 1)).float()  # [b, s]
            mask = torch.zeros_like(per_token)
            mask[:, max(prompt_len - 1, 0) : -1] = 1.0  # the last label wraps around
            per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
            if advantages is not None:
                per_seq = per_seq * torch.as_tensor(advantages, dtype=torch.float32)[rows]
            loss = per_seq.mean()
            loss.backward()
            for p in self.model.parameters():
                if p.grad is not None and dp > 1:
                    g = p.grad.float()
                    torch.distributed.all_reduce(g, group=group)
                    p.grad.copy_(g / dp)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        return float(mean) / self.world

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights Megatron holds, gathered over TP and converted plainly to Hugging
        Face names, on rank 0 (a collective: every rank calls)."""
        from actors.tools.testkit.megatron_hf import (
            first_expert,
            hf_from_megatron,
            model_dims,
            stage_layers,
            tp_full,
        )

        full = {n: tp_full(n, p).clone() for n, p in self.model.named_parameters()}
        if self.rank != 0:
            return None
        d = model_dims(self.model, self.config.model.vocab_size)
        return hf_from_megatron(full, stage_layers(self.model), first_expert(self.model),
                                tp=d.tp, heads=d.heads, groups=d.groups, vocab=d.vocab)


MegatronTrainerActor = ray.remote(MegatronTrainerWorker)
