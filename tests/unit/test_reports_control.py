"""Control-plane pieces without Ray: merged trainer metadata, plan summaries, failed-write
records, the call ledger, the config checks, and the trainer's loss and batch split."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors.config import TransferConfig
from actors.controller.calls import ControlLedger, pickled_size
from actors.controller.schedule_actor import merge_trainer_metas, summarize
from actors.messages import TrainerRankMeta
from actors.ready.trainer_model import rank_rows, sequence_loss
from actors.write_guard import WriteGuard
from scheduling import compute_plan, load_cluster_config
from scheduling.config_metadata import engine_metas_from_config, trainer_meta_from_config
from weight_transfer.model.models import load_model_config
from weight_transfer.transport.base import PeerUnreachableError
from weight_transfer.types import MeshDesc, ParamMeta, Piece, Placement, RegionDesc, WriteTask

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHARD0 = (Placement(kind="shard", dim=0),)


def _param(name, shape=(8, 4), ranks=(0, 1)):
    return ParamMeta(name=name, shape=shape, dtype="bfloat16",
                     mesh=MeshDesc(ranks=ranks, shape=(len(ranks),)), placements=SHARD0)


def _rank(rank, params, world=2, naming="per_expert"):
    return TrainerRankMeta(rank=rank, world=world, node="n", expert_naming=naming,
                           params=tuple(params))


def test_merge_lists_every_parameter_once_in_first_seen_order():
    a, b, c = _param("a"), _param("b"), _param("c", ranks=(1,))
    params, naming = merge_trainer_metas([_rank(1, [b, a, c]), _rank(0, [a, b])])
    assert [p.name for p in params] == ["a", "b", "c"] and naming == "per_expert"


@pytest.mark.parametrize(
    "metas, message",
    [
        ([], "no trainer metadata"),
        ([_rank(0, []), _rank(0, [])], r"from ranks \[0, 0\]; expected each of 0..1"),
        ([_rank(0, [_param("a")]), _rank(1, [_param("a", shape=(8, 5))])],
         r"ranks 0 and 1 disagree on parameter 'a': \(8, 4\)"),
        ([_rank(0, [_param("a")]), _rank(1, [])], r"'a' lives on mesh \(0, 1\) but ranks \[1\]"),
        ([_rank(0, []), _rank(1, [], naming="stacked")], "disagree on expert naming"),
    ],
)
def test_merge_refuses_inconsistent_metadata(metas, message):
    with pytest.raises(ValueError, match=message):
        merge_trainer_metas(metas)


def test_summary_counts_bytes_per_rank_replica_and_nic():
    cfg = load_model_config(CONFIGS / "models" / "tiny_llama.yaml")
    cluster = load_cluster_config(CONFIGS / "clusters" / "local_cpu.yaml")
    plan = compute_plan(trainer_meta_from_config(cfg, cluster),
                        engine_metas_from_config(cfg, cluster), cluster, model=cfg)
    s = summarize(plan, plan_id=1, seconds=0.5, expert_naming="per_expert")
    assert s.replicas == ("engine0", "engine1") and s.num_tasks == plan.num_tasks
    total = plan.bytes_total
    for counts in (s.bytes_by_rank, s.bytes_by_replica, s.send_nic_bytes, s.recv_nic_bytes):
        assert sum(counts.values()) == total
    assert s.bytes_by_replica["engine0"] == s.bytes_by_replica["engine1"] == total // 2
    assert all(set(r) <= set(s.replicas) for r in s.replicas_by_rank.values())
    assert set(s.replicas_by_rank) == {0, 1, 2, 3}


def _task(task_id, replica, owner, nbytes=100):
    region = RegionDesc(owner=owner, nic="n0", addr=4096, length=1 << 20, rkey=task_id + 1)
    piece = Piece(dst_tensor="w", dst_offset=0, nbytes=nbytes, src_param="w",
                  src_slice=((0, nbytes // 2),), dst_dtype="bfloat16")
    return WriteTask(task_id=task_id, mesh_group=0, src_rank=0, piece=piece, dst_replica=replica,
                     dst_rank=0, region=region, region_offset=0)


def test_write_guard_records_failures_per_replica_with_the_first_error():
    guard = WriteGuard(label="trainer rank 0")
    guard.record(_task(1, "engine1", "engine1/tp1"), PeerUnreachableError("peer engine1 is gone"))
    guard.record(_task(2, "engine1", "engine1/tp1"), PeerUnreachableError("later"))
    guard.record(_task(3, "engine0", "engine0/tp0", nbytes=40), PeerUnreachableError("x"))
    f0, f1 = guard.failures()
    assert (f0.replica, f0.owner, f0.count, f0.nbytes) == ("engine0", "engine0/tp0", 1, 40)
    assert (f1.replica, f1.owner, f1.count, f1.nbytes) == ("engine1", "engine1/tp1", 2, 200)
    assert f1.error == "PeerUnreachableError: peer engine1 is gone"
    guard.reset()
    assert guard.failures() == []


def test_ledger_counts_pickled_arguments_and_results():
    class Method:
        def remote(self, *args, **kwargs):
            return ("ref", args, kwargs)

    ledger = ControlLedger()
    snap = ledger.snapshot()
    ledger.call(Method(), 7, flag=True)
    ledger.record_result({"rank": 0})
    nbytes, calls = ledger.since(snap)
    assert calls == 1
    assert nbytes == pickled_size(((7,), {"flag": True})) + pickled_size({"rank": 0})


def test_config_checks_and_replica_growth():
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                    CONFIGS / "clusters" / "local_cpu.yaml")
    assert cfg.engine_fp8 is False and cfg.replace(fp8=True).engine_fp8 is True
    grown = cfg.with_replicas(3)
    assert grown.cluster.inference.replicas == 3 and cfg.cluster.inference.replicas == 2
    assert grown.cluster.engine_rank(2, 1)[1] == "inode2/nic1"
    with pytest.raises(ValueError, match=r"TransferConfig\.update_timeout_s: Input should be "
                                         "greater than 0"):
        cfg.replace(update_timeout_s=0)
    with pytest.raises(ValueError, match=r"TransferConfig\.nic_gbps: Input should be greater"):
        cfg.replace(nic_gbps=-1.0)
    with pytest.raises(ValueError, match=r"TransferConfig\.seed: Extra inputs are not permitted"):
        cfg.replace(seed=1)  # the ready-made trainers' seed is a DemoActorConfig's


@pytest.mark.parametrize("batch, world, rank, want", [
    (8, 4, 1, slice(2, 4)), (4, 4, 3, slice(3, 4)), (3, 4, 2, slice(0, 3)), (6, 4, 0, slice(0, 6)),
])
def test_rank_rows_split_a_batch_evenly_or_not_at_all(batch, world, rank, want):
    assert rank_rows(batch, rank=rank, world=world) == want


def test_sequence_loss_is_the_weighted_nll_after_the_prompt():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    logp = F.log_softmax(logits, dim=-1)
    nll = [-(sum(logp[b, t - 1, ids[b, t]] for t in range(2, 5)) / 3) for b in range(2)]
    weights = torch.tensor([2.0, -1.0])
    got = sequence_loss(logits, ids, prompt_len=2, weights=weights)
    assert math.isclose(got.item(), ((2 * nll[0] - nll[1]) / 2).item(), rel_tol=1e-5)
    plain = sequence_loss(logits, ids, prompt_len=0, weights=None)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert math.isclose(plain.item(), want.item(), rel_tol=1e-5)
