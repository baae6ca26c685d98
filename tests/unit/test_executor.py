"""RankTransfer: a real plan replayed through the stage pipeline into simnic regions.

Parameters here are plain full tensors (``full_tensor`` is the identity); the
multi-process FSDP2 test in tests/integration covers DTensor gathers.
"""

import asyncio
import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.engines.reference.loader import load_engine_shard
from weight_transfer.engines.reference.random_state import random_state_dict
from weight_transfer.integrity.checksums import IntegrityPolicy
from weight_transfer.model.models import load_model_config
from weight_transfer.sender.executor import RankTransfer, check_trainer_plan
from weight_transfer.sender.pipeline import PipelineError
from weight_transfer.sender.prepare import as_bytes
from weight_transfer.sender.retry import RetryPolicy
from weight_transfer.transport.base import RemoteAccessError
from weight_transfer.transport.simnic.nic import SimNic

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class Setup:
    """Engine buffers registered on one simnic target; a plan over their real regions."""

    def __init__(self, model: str, *, fp8: bool, bandwidth_gbps=None, gather="shard_direct"):
        self.cfg = load_model_config(CONFIGS / "models" / f"{model}.yaml")
        self.cluster = load_cluster_config(CONFIGS / "clusters" / "local_cpu.yaml")
        self.state = random_state_dict(self.cfg, seed=3)
        self.trainer_meta = trainer_meta_from_config(self.cfg, self.cluster)
        self.targets = {}  # one simulated NIC per engine NIC of the cluster, all in this process
        self.buffers = {}
        engines = []
        for e in engine_metas_from_config(self.cfg, self.cluster, fp8=fp8):
            fake = e.tensors[0].region
            buf = torch.zeros(fake.length, dtype=torch.uint8)
            target = self.targets.setdefault(fake.nic, SimNic(owner="engines", nic=fake.nic))
            real = target.register(buf)
            self.buffers[(e.replica, e.rank)] = buf
            tensors = tuple(dataclasses.replace(t, region=real) for t in e.tensors)
            engines.append(dataclasses.replace(e, tensors=tensors))
        self.engines = engines
        self.plan = compute_plan(self.trainer_meta, engines, self.cluster, model=self.cfg, fp8=fp8,
                                 gather=gather)
        self.writer = SimNic(owner="trainers", nic="trainer-nic", bandwidth_gbps=bandwidth_gbps)
        for target in self.targets.values():
            self.writer.connect(target.peer_info("trainers"))

    def transfer(self, rank, **kw):
        # These tests count bytes, writes and failures: no checksums, no retries unless given.
        kw.setdefault("integrity", IntegrityPolicy(mode="off"))
        kw.setdefault("retry", RetryPolicy(attempts=1))
        return RankTransfer(
            plan=self.plan.trainer_plan(rank),
            params=self.trainer_meta.params,
            get_param=self.state.__getitem__,
            transport=self.writer,
            **kw,
        )

    def engine_bytes(self, e):
        buf = self.buffers[(e.replica, e.rank)]
        return {t.name: buf[t.offset : t.offset + t.nbytes] for t in e.tensors}

    def close(self):
        self.writer.close()
        for target in self.targets.values():
            target.close()


@pytest.mark.parametrize("gather", ["shard_direct", "full"])
@pytest.mark.parametrize("model,fp8", [("tiny_llama", False), ("tiny_moe", False),
                                       ("tiny_moe", True)])
def test_every_engine_byte_equals_reference(model, fp8, gather):
    s = Setup(model, fp8=fp8, gather=gather)
    try:
        async def run_all():
            return [await s.transfer(r.rank, watermark_bytes=4 << 20).run(version=1)
                    for r in s.trainer_meta.ranks]

        reports = asyncio.run(run_all())
        assert sum(r.bytes_written for r in reports) == s.plan.bytes_total
        for e in s.engines:
            want = load_engine_shard(s.cfg, s.state, e.shard, fp8=fp8)
            got = s.engine_bytes(e)
            assert set(got) == set(want)
            for name, ref in want.items():
                assert torch.equal(got[name], as_bytes(ref)), (e.replica, e.rank, name)
    finally:
        s.close()


def test_watermark_peak_bounded_and_oversized_params_still_run():
    s = Setup("tiny_moe", fp8=False, gather="full")
    try:
        biggest = max(p.nbytes for p in s.trainer_meta.params)
        limit = biggest // 2  # smaller than the embedding: it must run alone, not deadlock
        reports = [
            asyncio.run(asyncio.wait_for(s.transfer(r.rank, watermark_bytes=limit).run(1), 60))
            for r in s.trainer_meta.ranks
        ]
        for rep in reports:
            assert rep.params_gathered > 0
        # A rank's peak exceeds the limit only by an item admitted alone.
        assert any(rep.watermark_peak > limit for rep in reports)
        roomy = asyncio.run(s.transfer(0, watermark_bytes=1 << 30).run(2))
        assert roomy.watermark_peak <= 1 << 30
    finally:
        s.close()


@pytest.mark.parametrize("gather", [{"gather": "param"},
                                    {"gather": "bucket", "bucket_bytes": 1 << 20}])
def test_capped_writes_overlap_with_later_prepares(gather):
    s = Setup("tiny_llama", fp8=False, bandwidth_gbps=0.02)
    try:
        rep = asyncio.run(s.transfer(0, watermark_bytes=64 << 20, **gather).run(version=1))
        spans = {(sp.key, sp.stage): sp for sp in rep.spans}
        order = [sp.key for sp in rep.spans if sp.stage == "prepare"]
        overlapped = [
            a for a, b in itertools.pairwise(order)
            if (a, "write") in spans and spans[(b, "prepare")].start < spans[(a, "write")].end
        ]
        assert overlapped, "no prepare ran while an earlier write was in flight"
        serial = asyncio.run(s.transfer(0, serial=True).run(version=2))
        sp2 = sorted(serial.spans, key=lambda x: x.start)
        for a, b in itertools.pairwise(sp2):
            assert b.start >= a.end - 1e-9  # serial mode: nothing overlaps
    finally:
        s.close()


def test_plan_that_does_not_match_metadata_is_rejected():
    s = Setup("tiny_llama", fp8=False)
    try:
        tp = s.plan.trainer_plan(0)
        with pytest.raises(ValueError, match="unknown parameters"):
            check_trainer_plan(tp, s.trainer_meta.params[1:])
        other = s.plan.trainer_plan(1)
        bad = dataclasses.replace(tp, groups=other.groups)
        with pytest.raises(ValueError, match="belongs to rank 1"):
            check_trainer_plan(bad, s.trainer_meta.params)
    finally:
        s.close()


class CountingParam:
    """Stands in for a DTensor: records every full_tensor() call (a collective)."""

    def __init__(self, name, full, log):
        self.name, self.full, self.log = name, full, log

    def full_tensor(self):
        self.log.append(self.name)
        return self.full


def test_each_rank_gathers_its_meshes_params_once_in_plan_order():
    s = Setup("tiny_moe", fp8=True, gather="full")
    try:
        for r in s.trainer_meta.ranks:
            log = []
            params = {n: CountingParam(n, t, log) for n, t in s.state.items()}
            tp = s.plan.trainer_plan(r.rank)
            transfer = RankTransfer(plan=tp, params=s.trainer_meta.params,
                                    get_param=params.__getitem__, transport=s.writer)
            asyncio.run(transfer.run(version=1))
            transfer.close()
            # Every parameter of the rank's meshes exactly once, in the plan's gather order,
            # including parameters this rank writes none of (fused parts read by other ranks).
            assert log == [n for g in tp.groups for n in g.params]
            written = {t.piece.src_param for t in tp.tasks}
            assert written <= set(log)
        # A rank that writes none of a parameter still joins its gather (the collective).
        tp = s.plan.trainer_plan(0)
        skip = tp.groups[0].params[0]
        g0 = dataclasses.replace(
            tp.groups[0], tasks=tuple(t for t in tp.groups[0].tasks if t.piece.src_param != skip)
        )
        lean = dataclasses.replace(tp, groups=(g0, *tp.groups[1:]))
        log = []
        params = {n: CountingParam(n, t, log) for n, t in s.state.items()}
        transfer = RankTransfer(plan=lean, params=s.trainer_meta.params,
                                get_param=params.__getitem__, transport=s.writer)
        rep = asyncio.run(transfer.run(version=2))
        transfer.close()
        assert log.count(skip) == 1
        assert rep.writes == len(lean.tasks)
    finally:
        s.close()


def test_every_task_records_a_write_span_inside_its_parameters_write_span():
    s = Setup("tiny_moe", fp8=True, bandwidth_gbps=0.5)
    try:
        tp = s.plan.trainer_plan(1)
        transfer = s.transfer(1)
        rep = asyncio.run(transfer.run(version=1))
        bucket_of = {m.name: b.key for bs in transfer.buckets for b in bs for m in b.params}
        by_id = {sp.key: sp for sp in rep.task_spans}
        assert sorted(by_id) == sorted(t.task_id for t in tp.tasks)
        param_write = {sp.key: sp for sp in rep.spans if sp.stage == "write"}
        for t in tp.tasks:
            sp, outer = by_id[t.task_id], param_write[bucket_of[t.piece.src_param]]
            assert sp.nbytes == t.nbytes and sp.end >= sp.start
            assert outer.start <= sp.start and sp.end <= outer.end
        assert sum(sp.nbytes for sp in rep.task_spans) == rep.bytes_written
    finally:
        s.close()


def test_failed_writes_are_not_counted_as_written_and_the_transfer_goes_on():
    s = Setup("tiny_llama", fp8=False)
    try:
        engine = s.engines[0]
        revoked = engine.tensors[0].region
        s.targets[revoked.nic].deregister(revoked)  # no write into it lands any more
        tp = s.plan.trainer_plan(0)
        lost = [t for t in tp.tasks if t.region == revoked]
        assert 0 < len(lost) < len(tp.tasks)
        failed = []
        transfer = s.transfer(0, on_write_error=lambda task, exc: failed.append((task, exc)))
        rep = asyncio.run(transfer.run(version=1))
        assert sorted(t.task_id for t, _ in failed) == sorted(t.task_id for t in lost)
        assert all(isinstance(exc, RemoteAccessError) for _, exc in failed)
        assert rep.bytes_planned == sum(t.nbytes for t in tp.tasks)
        landed = s.writer.bytes_written
        assert rep.bytes_written == landed == rep.bytes_planned - sum(t.nbytes for t in lost)
        assert rep.bytes_written < rep.bytes_planned
        assert rep.writes == len(tp.tasks) - len(lost) == len(rep.task_spans)
        assert not s.buffers[(engine.replica, engine.rank)].any()
        with pytest.raises(PipelineError, match="no live region"):  # no hook: abort
            asyncio.run(s.transfer(0).run(version=2))
    finally:
        s.close()


@pytest.mark.parametrize("gather", ["shard_direct", "full"])
def test_parameters_that_require_grad_leave_no_autograd_graph(gather):
    """A trainer's parameters require grad: cutting and quantizing them must build no
    graph (it kept every float32 temporary of the quantizer alive, plan after plan)."""
    import gc

    s = Setup("tiny_moe", fp8=True, gather=gather)
    try:
        s.state = {k: v.requires_grad_() if v.is_floating_point() else v
                   for k, v in s.state.items()}

        def graphs() -> list[torch.Tensor]:
            gc.collect()
            return [t for t in gc.get_objects()
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None]

        kept = graphs()  # other tests' leftovers in this process, held so no new tensor
        before = {id(t) for t in kept}  # can reuse one of their ids

        async def run_all():
            for r in s.trainer_meta.ranks:
                await s.transfer(r.rank, watermark_bytes=4 << 20).run(version=1)

        asyncio.run(run_all())
        assert [t for t in graphs() if id(t) not in before] == []
        for e in s.engines:  # and the bytes are those of the same weights without grad
            want = load_engine_shard(s.cfg, {k: v.detach() for k, v in s.state.items()},
                                     e.shard, fp8=True)
            got = s.engine_bytes(e)
            for name, ref in want.items():
                assert torch.equal(got[name], as_bytes(ref)), (e.replica, e.rank, name)
    finally:
        s.close()
