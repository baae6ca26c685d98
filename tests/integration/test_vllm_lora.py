"""A PEFT LoRA adapter written one-sided into a real vLLM's adapter slots (issue 35).

One vLLM engine for the module (tiny Llama, float32, TP=1, ``enable_lora=True``,
``max_loras=3``: our two slots and one for vLLM's own load of the oracle; rank 4 under
``max_lora_rank=8``, so each lora_B is written as whole rows zero-padded to 8), about
35-60 s to start here; the tests after it take a few seconds. The oracles
(actors/tools/testkit/lora_oracle.py):

1. the served slot's bytes, after our write and the flip, equal the bytes vLLM's own
   load of a PEFT checkpoint of the same adapter (``save_pretrained``, loaded through
   a ``LoRARequest`` with its path) puts in its slot, in every slot tensor;
2. greedy tokens under the served name equal those of that checkpoint loaded from disk;
   a new version is served after its flip, the previous one until then, and a rollback
   gives the previous version's tokens exactly.

Bad input (rank over ``max_lora_rank``, a module without a LoRA slot, an adapter of another
base model, an update that does not match its setup, an adapter update on a base the engine
does not hold, too few slots) is refused by name with nothing written. The tests
run in file order on the one engine (version 1, then version 2 and the rollback).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from actors.tools.testkit.lora_oracle import next_step, peft_adapter, snapshot
from actors.tools.testkit.vllm_oracle import connect_link, save_checkpoint, start_llm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
pytest.importorskip("peft", reason="the `lora` extra (peft) is not installed")

LLAMA = Path(__file__).parents[2] / "configs" / "models" / "tiny_llama.yaml"
PROMPTS = [[1, 5, 9, 200], [7, 7, 3], [42]]
ENIC, TNIC = "inode0/nic0", "tnode0/nic0"
ORACLE_ID = 7


def slot_differences(llm, served_id: int, oracle_id: int) -> list[str]:
    """Every slot tensor whose bytes in the served adapter's slot differ from the slot vLLM
    loaded the oracle checkpoint into (the oracle: :mod:`actors.tools.testkit.lora_oracle`)."""
    from actors.tools.testkit.lora_oracle import slot_differences as differences

    return llm.collective_rpc(differences, args=(served_id, oracle_id))[0]


def slot_ids(llm) -> list:
    from actors.tools.testkit.lora_oracle import slot_ids as ids

    return llm.collective_rpc(ids)[0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from weight_transfer.engines.vllm.driver import VllmLink
    from weight_transfer.engines.vllm.lora.link import LoraLink
    from weight_transfer.engines.vllm.mailbox import SetupRequest
    from weight_transfer.transport.options import DEFAULT_TRANSPORT

    root = tmp_path_factory.mktemp("lora")
    base, path = save_checkpoint(LLAMA, seed=11, root=root)
    model = peft_adapter(base, seed=1)
    v1 = snapshot(model, root, "adapter-v1")
    next_step(model, seed=2)  # the trainer's next step: new adapter values, same shapes
    v2 = snapshot(model, root, "adapter-v2")
    llm = start_llm(path, enable_lora=True, max_loras=3, max_lora_rank=8)
    link = VllmLink(llm)
    (meta,) = link.setup(SetupRequest(replica="engine0", nics=((ENIC,),),
                                      transport=DEFAULT_TRANSPORT))
    nic = connect_link(link, meta, DEFAULT_TRANSPORT, trainer="trainer0", nic=TNIC)
    lora = LoraLink(link, name="policy", lora_int_id=1)
    ns = SimpleNamespace(llm=llm, link=link, lora=lora, nic=nic, model=model, v1=v1, v2=v2,
                         root=root, lmeta=None, base_meta=meta, buffer=None)
    yield ns
    try:
        link.close()
    finally:
        llm.llm_engine.engine_core.shutdown()


def oracle_tokens(ns, path: Path):
    from vllm.lora.request import LoRARequest

    request = LoRARequest(f"oracle-{path.name}", ORACLE_ID, str(path), load_inplace=True)
    return ns.link.generate(PROMPTS, 8, lora_request=request)


def write(ns, tensors, base_version=None, *, reuse: bool = True) -> int:
    """One version written into the free slot (``reuse``: prepared into the buffer allocated
    once, as a trainer does every step; else into new tensors)."""
    from weight_transfer.sources.lora import adapter_buffer, write_adapter

    slot = ns.lora.begin(base_version=base_version)
    if reuse and getattr(ns, "buffer", None) is None:
        ns.buffer = adapter_buffer(ns.lmeta)
    return asyncio.run(write_adapter(ns.nic, ns.lmeta, slot, tensors,
                                     buffer=ns.buffer if reuse else None))


def test_too_few_slots_is_refused_naming_the_numbers():
    from weight_transfer.engines.vllm.lora.slots import check_capacity

    with pytest.raises(ValueError, match=r"needs 2 LoRA slots.*max_loras=1, max_cpu_loras=1"):
        check_capacity(SimpleNamespace(max_loras=1, max_cpu_loras=1))
    check_capacity(SimpleNamespace(max_loras=2, max_cpu_loras=2))


def test_adapters_the_engine_cannot_hold_are_refused_with_nothing_written(engine):
    from weight_transfer.engines.vllm.lora.spec import AdapterSpec
    from weight_transfer.sources.lora import describe_peft

    good = describe_peft(engine.model)
    too_big = AdapterSpec(config_json=good.config_json.replace('"r": 4', '"r": 16'),
                          params=good.params)
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        engine.lora.setup(too_big, nics=((ENIC,),))
    config = {**good.config, "target_modules": ["rotary"]}
    alien = AdapterSpec.of(config, {
        "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": ((4, 256), "float32"),
        "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": ((256, 4), "float32"),
    })
    with pytest.raises(ValueError, match=r"self_attn\.rotary\.lora_A\.weight: module "
                                         r"'model\.layers\.0\.self_attn\.rotary' has no LoRA slot"):
        engine.lora.setup(alien, nics=((ENIC,),))
    assert slot_ids(engine.llm) == [None, None, None]  # no slot taken, none written


def test_an_adapter_of_another_base_model_is_refused_with_nothing_written(engine):
    """An adapter trained on a Llama with another MLP width: wider (its blocks overflow the
    slots) or narrower (vLLM's set_lora would load it silently, zeros beside it)."""
    from weight_transfer.engines.reference.hf_model import build_hf_model
    from weight_transfer.model.models import load_model_config
    from weight_transfer.sources.lora import describe_peft

    cfg = load_model_config(LLAMA).model_copy(update={"torch_dtype": "float32"})
    for width, what in ((384, r"mlp\.gate_proj\.lora_B\.weight \(384, 4\): fills 1536 of the "
                                r"2048 elements"),
                        (1024, r"mlp\.down_proj\.lora_A\.weight \(4, 1024\): a \(4, 1024\) "
                               r"block into a \(4, 512\) view")):
        other = build_hf_model(cfg.model_copy(update={"intermediate_size": width}), seed=3,
                               dtype=torch.float32)
        spec = describe_peft(peft_adapter(other, seed=3))
        with pytest.raises(ValueError, match=r"(?s)LoRA adapter of another base model.*" + what):
            engine.lora.setup(spec, nics=((ENIC,),))
    assert slot_ids(engine.llm) == [None, None, None]  # no slot taken, none written


def test_slot_bytes_and_tokens_equal_vllms_own_load(engine):
    from weight_transfer.sources.lora import describe_peft
    from weight_transfer.types import Transform

    ns = engine
    (ns.lmeta,) = ns.lora.setup(describe_peft(ns.model), nics=((ENIC,),))
    assert len(ns.lmeta.slots) == 2 and dict(ns.lmeta.scaling) and \
        set(dict(ns.lmeta.scaling).values()) == {16 / 4}
    # rank 4 under max_lora_rank 8: each lora_B is one write of whole rows, zero-padded
    # (not one write per row); every lora_A is one contiguous run already
    b = [p for p in ns.lmeta.slot_pieces[0] if ".lora_b_stacked." in p.dst_tensor]
    assert b and {p.transform for p in b} == {Transform.PAD_COLS}
    assert len(b) == len({p.dst_tensor for p in b})
    base = ns.link.generate(PROMPTS, 8)
    tensors, path = ns.v1
    assert write(ns, tensors, reuse=False) == ns.lmeta.nbytes > 0
    assert ns.link.generate(PROMPTS, 8, lora_request=ns.lora.request()) == base  # not yet
    ns.lora.flip(version=1)
    ours = ns.link.generate(PROMPTS, 8, lora_request=ns.lora.request())
    assert ours == oracle_tokens(ns, path) != base
    assert slot_differences(ns.llm, 1, ORACLE_ID) == []
    ns.tokens_v1 = ours


def flip_mid_request(ns, version, *, after: int = 3, max_new_tokens: int = 64):
    """A generation under the adapter that the flip to ``version`` overtakes: the engine
    is held at a step boundary once the first request has ``after`` tokens, the flip runs
    there (and lets the engine go on); the generations, with their adapter versions."""
    held, out = threading.Event(), {}

    def on_step(i, n, stamp):
        if i == 0 and n >= after and not held.is_set():
            ns.link.gate.pause(60)  # no step of ours until the flip
            ns.link._scheduler(pause=True)  # nor of vLLM's engine core
            held.set()

    def generate():
        out["gens"] = ns.lora.generate_tagged(PROMPTS, max_new_tokens, on_step=on_step)

    thread = threading.Thread(target=generate)
    thread.start()
    assert held.wait(120)
    ns.lora.flip(version=version)
    thread.join(120)
    return out["gens"]


def test_new_version_while_serving_then_rollback(engine):
    """A request carries the adapter versions it ran with: one version, or the two a flip
    in the middle of it gave (its first tokens those of the version before)."""
    ns = engine
    tensors, path = ns.v2
    write(ns, tensors)  # into the free slot: the name still serves version 1
    assert ns.link.generate(PROMPTS, 8, lora_request=ns.lora.request()) == ns.tokens_v1
    overtaken = flip_mid_request(ns, 2)
    assert overtaken[0].versions == (1, 2)
    cut = overtaken[0].spans[1].start
    assert cut >= 3 and overtaken[0].tokens[:min(cut, 8)] == tuple(ns.tokens_v1[0][:cut])
    v2 = ns.link.generate(PROMPTS, 8, lora_request=ns.lora.request())
    assert v2 == oracle_tokens(ns, path) != ns.tokens_v1
    assert slot_differences(ns.llm, 1, ORACLE_ID) == []
    assert [g.versions for g in ns.lora.generate_tagged(PROMPTS, 8)] == [(2,)] * 3
    ns.lora.rollback()
    back = ns.lora.generate_tagged(PROMPTS, 8)
    assert [list(g.tokens) for g in back] == ns.tokens_v1
    assert [g.versions for g in back] == [(1,)] * 3 and ns.lora.version == "1"
    with pytest.raises(ValueError, match="no previous version held"):
        ns.lora.rollback()


def test_an_update_unlike_its_setup_writes_nothing(engine):
    from weight_transfer.sources.lora import write_adapter

    ns = engine
    tensors, _ = ns.v2
    name = next(iter(tensors))
    before = ns.link.call("stats")[0]["bytes_written"]
    slot = ns.lora.begin()
    broken = {**tensors, name: tensors[name][:-1]}
    with pytest.raises(ValueError, match=rf"{name}: shape .* set up with"):
        asyncio.run(write_adapter(ns.nic, ns.lmeta, slot, broken))
    del broken[name]
    with pytest.raises(ValueError, match=rf"{name}: missing"):
        asyncio.run(write_adapter(ns.nic, ns.lmeta, slot, broken))
    assert ns.link.call("stats")[0]["bytes_written"] == before
    ns.lora.discard()
    assert ns.link.generate(PROMPTS, 8, lora_request=ns.lora.request()) == ns.tokens_v1


def test_a_base_update_then_an_adapter_update(engine):
    """Full weights and the adapter in one run, over the same NIC: the base moves to a new
    checkpoint (every registered byte equal to vLLM's load_weights of it; vLLM then drops
    its adapters, ours too), and the adapter written again is served on the new base
    exactly as vLLM's own load of that adapter from disk is."""
    from actors.tools.testkit.vllm_oracle import (
        compare_to_oracle,
        oracle_load,
        registered_tensors,
        write_update,
    )
    from weight_transfer.sources.lora import BaseWatch

    ns = engine
    watch = BaseWatch(ns.model)  # the engine holds the trainer's base (one checkpoint)
    assert watch.check() is None
    new_base, new_path = save_checkpoint(LLAMA, seed=12, root=ns.root)
    held = dict(ns.model.get_base_model().named_parameters())
    with torch.no_grad():  # the trainer's base moves on (the adapter's tensors stay)
        for name, p in new_base.named_parameters():
            peft_name = name if name in held else name.replace(".weight", ".base_layer.weight")
            held[peft_name].copy_(p)
    before = ns.link.call("stats")[0]["bytes_written"]
    with pytest.raises(ValueError, match=r"base weights changed since the engine's copy was "
                                         r"loaded \(\d+ parameters: base_model\.model\.lm_head"):
        write(ns, ns.v1[0], base_version=watch.check())
    with pytest.raises(ValueError, match="trained on base version 2, the engine serves base "
                                         "version"):
        write(ns, ns.v1[0], base_version=2)
    assert ns.link.call("stats")[0]["bytes_written"] == before
    assert ns.link.generate(PROMPTS, 8, lora_request=ns.lora.request()) == ns.tokens_v1
    ns.link.pause()
    write_update(ns.nic, ns.base_meta, {n: p.detach() for n, p in new_base.named_parameters()})
    ns.link.resume(version=2)
    watch.synced(2)
    actual = ns.llm.collective_rpc(registered_tensors)[0]
    assert compare_to_oracle(actual, ns.llm.collective_rpc(oracle_load,
                                                           args=(str(new_path),))[0]) == []
    tensors, path = ns.v1
    write(ns, tensors, base_version=watch.check())
    ns.lora.flip(version=4)
    ours = ns.link.generate(PROMPTS, 8, lora_request=ns.lora.request())
    assert ours == oracle_tokens(ns, path) != ns.tokens_v1  # v1 adapter, new base
    assert slot_differences(ns.llm, 1, ORACLE_ID) == []


def test_bench_lora_smoke(engine):
    """``wt bench lora`` on this engine: rank 8, one update per design, each verified by its
    oracle (slot bytes against vLLM's own load; the merged model's bytes against vLLM's
    load_weights); ours moves the fewest bytes."""
    from dataclasses import asdict

    from actors.tools.bench.lora.bench import bench_rank
    from actors.tools.bench.lora.designs import DESIGNS, attach_rig
    from weight_transfer.model.models import load_model_config

    ns = engine
    ns.lora.close()  # its two slots and the oracle's one serve the bench
    ns.llm.llm_engine.remove_lora(ORACLE_ID)
    rig = attach_rig(ns.llm, model_cfg=load_model_config(LLAMA), root=ns.root,
                     dtype=torch.float32, link=ns.link, metas=[ns.base_meta], nics=[ns.nic])
    runs = bench_rank(rig, 8, list(DESIGNS), 1, idle_s=0.5, warmup=False)
    assert [r.design for r in runs] == ["ours", "disk", "merged"]
    assert all(r.verified and r.seconds > 0 and r.rank == 8 and r.tp == 1 for r in runs), runs
    by = {r.design: r for r in runs}
    assert by["ours"].bytes == sum(m.nbytes for m in rig.lmetas) < by["merged"].bytes
    assert set(asdict(runs[0])) == {"design", "rank", "tp", "seconds", "bytes",
                                    "max_step_gap_s", "idle_step_gap_s", "verified"}
