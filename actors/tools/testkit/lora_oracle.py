"""Test scaffolding for LoRA adapters in vLLM: a random PEFT adapter, its checkpoint, and the
slot oracle (the library never imports it).

The oracle compares, in the worker, the bytes of the slot that serves our adapter with the
slot vLLM filled by its own load of a PEFT checkpoint of the same adapter (a
``LoRARequest`` with the checkpoint's path)::

    model = peft_adapter(base, seed=1, r=8)                 # random non-zero A and B
    tensors, path = snapshot(model, root, "adapter-v1")      # what the trainer writes; disk
    llm.generate(..., lora_request=LoRARequest("oracle", 7, str(path)))   # vLLM loads it
    assert llm.collective_rpc(slot_differences, args=(1, 7))[0] == []

Worker functions travel as callables (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), or by name
through :class:`actors.tools.testkit.vllm_oracle_ext.OracleExtension`
(``collective_rpc("wt_lora_slot_differences", args=(1, 7))``; over a server's HTTP route the
arguments arrive as strings). A server has no ``LoRARequest`` with a path to send: the
extension's ``wt_lora_load(name, id, path)`` (:func:`load_checkpoint`) is vLLM's own load of
a checkpoint into a slot (its ``add_lora``), which a name served as that id then runs.

The flow every shape runs (:func:`check_adapter_flow`) reaches the engine through an
:class:`AdapterAccess`; :func:`adapter_flow` is it for a user's actor (``wt_lora``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(base: Any, *, seed: int, r: int = 4, alpha: int = 16) -> Any:
    """A PEFT model of ``base`` with random (non-zero) A and B, reproducible by ``seed``."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, cfg, adapter_name="default")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def next_step(model: Any, seed: int) -> None:
    """The trainer's next step: new adapter values, the same shapes (seeded by ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def snapshot(model: Any, root: Path, tag: str) -> tuple[dict[str, torch.Tensor], Path]:
    """The adapter's tensors now, and its PEFT checkpoint on disk (the oracle's input)."""
    from weight_transfer.sources.lora import adapter_tensors

    model.save_pretrained(root / tag)
    return {n: t.clone() for n, t in adapter_tensors(model).items()}, root / tag


def slot_differences(worker: Any, served_id: int, oracle_id: int) -> list[str]:
    """Worker side: every slot tensor whose bytes in the slot of adapter id ``served_id``
    differ from the slot vLLM loaded adapter id ``oracle_id`` into (one line naming the
    ids when either is in no slot). The ids may come as strings (a server's HTTP route)."""
    from weight_transfer.engines.vllm.lora.record import slot_tensors

    served_id, oracle_id = int(served_id), int(oracle_id)
    manager = worker.model_runner.model.lora_manager
    ids = manager.lora_index_to_id
    if served_id not in ids or oracle_id not in ids:
        return [f"adapter ids {served_id}, {oracle_id} not both in slots {list(ids)}"]
    a, b = ids.index(served_id), ids.index(oracle_id)
    return [n for n, t in slot_tensors(manager).items()
            if not torch.equal(t[a].view(torch.uint8), t[b].view(torch.uint8))]


def slot_ids(worker: Any) -> list[int | None]:
    """Worker side: the adapter id in each of vLLM's LoRA slots (None: empty)."""
    return list(worker.model_runner.model.lora_manager.lora_index_to_id)


def load_checkpoint(worker: Any, name: str, lora_int_id: int | str, path: str) -> bool:
    """Worker side: vLLM's own load of the PEFT checkpoint at ``path`` into a slot as adapter
    id ``lora_int_id`` (its ``add_lora``; in place: a load of the same id replaces it)."""
    from vllm.lora.request import LoRARequest

    return worker.add_lora(LoRARequest(name, int(lora_int_id), str(path), load_inplace=True))


class FlipAt:
    """``on_step`` for an adapter's ``generate_tagged`` run in the user's actor (its
    ``wt_lora``): once the request has ``tokens`` tokens, the actor is asked for the flip
    of ``name`` to ``version`` (a Ray call not waited for, so the engine's loop runs on),
    at most once. A flip that overtakes the request is certain, not a matter of timing."""

    def __init__(self, name: str, version: Any, tokens: int) -> None:
        self.name, self.version, self.tokens = name, version, tokens
        self.sent = False

    def __call__(self, i: int, n: int, stamp: float | None) -> None:
        import ray

        if not self.sent and n >= self.tokens:
            self.sent = True
            actor = ray.get_runtime_context().current_actor
            actor.wt_lora.remote(self.name, "flip", self.version)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterAccess:
    """How a test reaches the adapter ``"policy"`` of one engine, in one shape.

    ``lora(method, *args, **kw)``: the adapter's ``LoraLink`` method (``"version"``: the
    version served); ``in_workers(method, *args)``: the first worker's answer of an oracle
    extension method; ``connect()``: the trainer's NIC, connected to the engine's rank 0;
    ``tokens(lora_request)``: the user's greedy tokens per prompt (None: the base model);
    ``oracle(path)``: those tokens under vLLM's own load of the PEFT checkpoint at ``path``,
    which then sits in a slot under the flow's ``oracle_id``."""

    lora: Callable[..., Any]
    in_workers: Callable[..., Any]
    connect: Callable[[], Any]
    tokens: Callable[[Any], Any]
    oracle: Callable[[Path], Any]


def adapter_flow(actor: Any, rank0: Any, *, root: Path, start_model: Any, rank: int,
                 tokens: Any, overtake: bool, oracle_id: int = 7) -> None:
    """A LoRA adapter driven through a user's actor's ``wt_lora`` (its engine started with
    ``enable_lora``, ``max_loras=3``, ``max_lora_rank=rank``, the oracle extension), this
    process as the trainer writing one-sided through ``rank0`` (the replica's VllmRank):
    :func:`check_adapter_flow` on base version 1, then a flip of the closed adapter is
    refused by name. ``tokens(lora_request)``: the user's own generate, greedy, per prompt.
    ``overtake``: see :func:`check_adapter_flow`."""
    import ray
    from vllm.lora.request import LoRARequest

    from actors import TransferConfig
    from actors.tools.testkit.vllm_oracle import connect_rank

    def lora(method: str, *args: Any, **kw: Any) -> Any:
        return ray.get(actor.wt_lora.remote("policy", method, *args, **kw))

    def in_workers(method: str, *args: Any) -> Any:
        return ray.get(actor.wt_vllm.remote("collective_rpc", method, args))[0]

    def connect() -> Any:
        return connect_rank(rank0, ray.get(rank0.wt_engine_meta.remote()),
                            TransferConfig().transport_spec, trainer="lora-trainer",
                            nic="tnode9/nic0")

    def oracle(path: Path) -> Any:  # vLLM's own load of the PEFT checkpoint
        return tokens(LoRARequest(f"oracle-{path.name}", oracle_id, str(path),
                                  load_inplace=True))

    access = AdapterAccess(lora=lora, in_workers=in_workers, connect=connect, tokens=tokens,
                           oracle=oracle)
    check_adapter_flow(access, root=root, start_model=start_model, rank=rank,
                       base_version="1", overtake=overtake, oracle_id=oracle_id)
    try:
        lora("flip", 3)
        raise AssertionError("a flip of a closed adapter was accepted")
    except ValueError as exc:
        assert "no adapter 'policy' set up on engine0" in str(exc), exc


def check_adapter_flow(access: AdapterAccess, *, root: Path, start_model: Any, rank: int,
                       base_version: Any, overtake: bool = False, oracle_id: int = 7) -> None:
    """The adapter ``"policy"`` of rank ``rank`` on an engine started with ``enable_lora``,
    ``max_loras=3``, ``max_lora_rank=rank`` and the oracle extension, serving base version
    ``base_version``; this process the trainer. Asserts: an adapter above ``max_lora_rank``
    is refused by name with no slot taken; a written version is served only after the flip;
    the slot bytes and the greedy tokens equal vLLM's own load of the PEFT checkpoint; a
    rollback gives the previous version's tokens exactly; ``close`` gives the slots back.
    ``overtake`` (an actor that serves calls concurrently, :class:`FlipAt`): a 200-token
    request under the adapter is overtaken by the flip to version 2, its tokens before the
    flip version 1's."""
    import asyncio

    from weight_transfer.engines.vllm.lora.spec import AdapterSpec
    from weight_transfer.sources.lora import adapter_buffer, describe_peft, write_adapter

    lora, in_workers, tokens = access.lora, access.in_workers, access.tokens
    model = peft_adapter(start_model, seed=1, r=rank)
    v1 = snapshot(model, root, "adapter-v1")
    next_step(model, seed=2)
    v2 = snapshot(model, root, "adapter-v2")
    spec = describe_peft(model)

    too_big = AdapterSpec(config_json=spec.config_json.replace(f'"r": {rank}', '"r": 16'),
                          params=spec.params)
    before = in_workers("wt_lora_slot_ids")  # empty, or an oracle an earlier test loaded
    try:
        lora("setup", too_big)
        raise AssertionError("an adapter of rank 16 was set up")
    except ValueError as exc:
        assert f"LoRA rank 16 is greater than max_lora_rank {rank}" in str(exc), exc
    assert in_workers("wt_lora_slot_ids") == before  # no slot taken, none written

    (meta,) = lora("setup", spec)
    request = lora("request")
    nic = access.connect()
    buffer = adapter_buffer(meta)

    def write(tensors: dict) -> None:
        slot = lora("begin", base_version)  # trained on the base version the engine serves
        assert asyncio.run(write_adapter(nic, meta, slot, tensors, buffer=buffer)) == \
            meta.nbytes > 0

    base = tokens(None)
    write(v1[0])
    assert tokens(request) == base  # written, not served yet
    assert lora("flip", 1) > 0
    ours_v1 = tokens(request)
    assert ours_v1 == access.oracle(v1[1]) != base
    assert in_workers("wt_lora_slot_differences", 1, oracle_id) == []

    write(v2[0])
    if overtake:  # the flip is asked for once the request has 20 of its 200 tokens
        (alone,) = lora("generate_tagged", [[1, 5, 9, 200]], 200)
        assert alone.versions == (1,)
        (overtaken,) = lora("generate_tagged", [[1, 5, 9, 200]], 200,
                            on_step=FlipAt("policy", 2, tokens=20))
        assert lora("version") == "2"
        assert len(overtaken.tokens) == 200 and overtaken.versions == (1, 2)
        cut = overtaken.spans[1].start
        assert 20 <= cut < 200 and overtaken.tokens[:cut] == alone.tokens[:cut]
    else:
        assert lora("flip", 2) > 0
    ours_v2 = tokens(request)
    assert ours_v2 == access.oracle(v2[1]) != ours_v1
    assert in_workers("wt_lora_slot_differences", 1, oracle_id) == []
    assert lora("rollback") > 0
    assert tokens(request) == ours_v1 and lora("version") == "1"
    lora("close")  # both slots back to vLLM; the oracle's stays
    after = in_workers("wt_lora_slot_ids")
    assert len(after) == len(before) and _held(after) == sorted({*_held(before), oracle_id})


def _held(slot_ids: list[int | None]) -> list[int]:
    """The adapter ids in slots, sorted (empty slots left out)."""
    return sorted(i for i in slot_ids if i is not None)
