"""Configs from what is live: a simulated cluster from the actors' counts, a written cluster
checked against the actors (naming both sides) before anything starts, and the model from
the trainer's live transformers model. No Ray: the checks run before any remote call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from actors.config import TransferConfig
from actors.controller.live_config import (
    check_actors,
    cluster_for_actors,
    replica_sizes,
    with_cluster,
)
from actors.ready.launch import launch_engines, launch_trainers
from actors.trainer import TrainerMixin
from actors.vllm.engine import launch_vllm_engines
from scheduling.cluster.config import load_cluster_config
from scheduling.cluster.defaults import ClusterMismatchError, check_cluster, simulated_cluster
from weight_transfer.errors import WeightTransferError
from weight_transfer.model.models import load_model_config, trainer_param_specs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LOCAL_CPU = CONFIGS / "clusters" / "local_cpu.yaml"  # 4 trainer ranks, 2 replicas x TP2


class Actor:
    """A stand-in for an actor handle: the checks only count them."""


def test_simulated_cluster_has_one_nic_per_rank():
    c = simulated_cluster(trainer_ranks=4, replicas=2, tensor_parallel=2, trainer_nodes=2)
    assert c.trainer_world == 4 and c.engine_world == 4 and c.source == ""
    assert [r.nic for r in c.rank_infos()] == ["tnode0/nic0", "tnode0/nic1", "tnode1/nic0",
                                               "tnode1/nic1"]
    assert c.engine_nics() == ["inode0/nic0", "inode0/nic1", "inode1/nic0", "inode1/nic1"]
    assert [str(c.engine_nic(1, r)) for r in (0, 1)] == ["inode1/nic0", "inode1/nic1"]
    with pytest.raises(ValueError, match="3 trainer ranks do not fill 2 nodes"):
        simulated_cluster(trainer_ranks=3, replicas=1, tensor_parallel=1, trainer_nodes=2)


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ({"trainer_ranks": 2}, "cluster says 4 trainer ranks ({src}: trainer.nodes 2 x "
                               "gpus_per_node 2), 2 trainer actors were given"),
        ({"replicas": 3}, "cluster says 2 inference replicas ({src}: inference.replicas), "
                          "3 were given"),
        ({"replica_ranks": {"engine1": 1}}, "cluster says tensor_parallel 2 ({src}: "
                                            "inference.tensor_parallel), replica engine1 has 1 "
                                            "ranks"),
    ],
)
def test_a_written_cluster_that_disagrees_names_both_sides(counts, message):
    cluster = load_cluster_config(LOCAL_CPU)
    with pytest.raises(ClusterMismatchError) as info:
        check_cluster(cluster, **counts)
    assert str(info.value) == message.format(src=LOCAL_CPU)
    assert isinstance(info.value, ValueError) and isinstance(info.value, WeightTransferError)
    check_cluster(cluster, trainer_ranks=4, replicas=1, replica_ranks={"engine0": 2})  # agrees


def test_a_cluster_derived_from_the_actors():
    trainers, replicas = [Actor(), Actor()], [[Actor(), Actor()], [Actor(), Actor()]]
    assert replica_sizes(replicas) == {"#0": 2, "#1": 2}
    assert replica_sizes([Actor(), Actor()]) is None  # flat: each actor says its replica
    c = cluster_for_actors(trainers, replicas)
    assert (c.trainer_world, c.inference.replicas, c.inference.tensor_parallel) == (2, 2, 2)
    cfg = with_cluster(TransferConfig(), trainers, replicas)
    assert cfg.cluster == c and cfg.model is None and not cfg.engine_fp8
    with pytest.raises(ValueError, match="list of replicas"):
        cluster_for_actors(trainers, [Actor()])
    with pytest.raises(ValueError, match=r"different TP sizes \[1, 2\]"):
        cluster_for_actors(trainers, [[Actor()], [Actor(), Actor()]])


def test_the_controller_config_is_checked_against_the_actors():
    cfg = TransferConfig(cluster=load_cluster_config(LOCAL_CPU))
    assert with_cluster(cfg, [Actor()] * 4, [[Actor()] * 2]) is cfg  # one of two replicas
    with pytest.raises(ClusterMismatchError, match="replica #0 has 3 ranks"):
        with_cluster(cfg, [Actor()] * 4, [[Actor()] * 3])
    with pytest.raises(ClusterMismatchError, match="2 trainer actors were given"):
        check_actors(cfg.cluster, trainers=[Actor()] * 2, engines=[Actor()] * 8)


def test_launch_helpers_check_before_anything_starts():
    cfg = TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml", LOCAL_CPU)
    for launch in (lambda: launch_engines(cfg, trainers=[Actor()] * 2),
                   lambda: launch_vllm_engines(cfg, "/nonexistent", trainers=[Actor()] * 2)):
        with pytest.raises(ClusterMismatchError, match="4 trainer ranks"):
            launch()  # no Ray call was made: Ray is not even initialized here
    with pytest.raises(ValueError, match=r"launch_trainers starts the actors "
                                         r"TransferConfig.model and cluster describe"):
        launch_trainers(TransferConfig())
    with pytest.raises(ValueError, match=r"TransferConfig.cluster describes"):
        launch_vllm_engines(TransferConfig(), "/nonexistent")


class _Trainer(TrainerMixin):
    def __init__(self, model: torch.nn.Module) -> None:
        self.wt_attach(model=model, rank=0, world=1)


def test_the_trainer_describes_its_live_model():
    yaml_cfg = load_model_config(CONFIGS / "models" / "tiny_mixtral.yaml")
    hf = transformers.MixtralConfig(**{k: getattr(yaml_cfg, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "vocab_size", "num_local_experts",
        "num_experts_per_tok")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    live = _Trainer(model).wt_model_config()
    assert live.architecture == "mixtral" and live.torch_dtype == "bfloat16"
    assert trainer_param_specs(live, expert_naming="stacked") == trainer_param_specs(
        yaml_cfg, expert_naming="stacked")
    with pytest.raises(ValueError, match=r"no Hugging Face \.config; give TransferConfig"):
        _Trainer(torch.nn.Linear(2, 2)).wt_model_config()
