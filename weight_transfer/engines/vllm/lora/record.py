"""Record, from vLLM itself, where each adapter parameter lands in vLLM's LoRA slots.

Runs inside a vLLM worker started with ``enable_lora=True``. vLLM's LoRA model
manager (``model.lora_manager``) wraps each target linear layer; the wrapper keeps
preallocated slot tensors ``lora_a_stacked`` / ``lora_b_stacked`` (one per fused
slice, ``[max_loras, 1, rows, cols]``) and fills slot ``i`` with ``set_lora(i, a, b)``,
slicing for its TP rank. This module drives exactly that path with vLLM's recording
tensors (``FakeRDTTensor``, zero storage) in place of the adapter's tensors:

1. the adapter's PEFT names become vLLM module names by vLLM's own
   ``parse_fine_tuned_lora_name`` (and the model's ``hf_to_vllm_mapper``);
2. vLLM's ``_create_merged_loras_inplace`` packs q/k/v into ``qkv_proj`` and
   gate/up into ``gate_up_proj`` as at a real load (with scaling 1, so nothing is
   multiplied: the scaling is carried beside the pieces, :func:`adapter_scaling`);
3. each wrapped layer's ``set_lora(slot, a, b)`` runs as ``activate_adapter`` runs it;
   every ``copy_`` into a slot tensor is recorded (source rectangle, strided
   destination) and becomes :class:`~weight_transfer.types.Piece` s, as the full-weight
   layout is recorded from ``load_weights`` (:mod:`..recording`).

``set_lora`` zeroes the slot first (``reset_lora``): record only slots that serve
nothing. :func:`check_adapter` refuses, by name and before anything is touched, an
adapter whose rank, features or target modules the engine's LoRA config cannot hold.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from weight_transfer.engines.vllm.lora.spec import AdapterSpec
from weight_transfer.layout.recording.slices import copy_pieces, rect_of_chain
from weight_transfer.types import Piece, Transform

log = logging.getLogger(__name__)

STACKS = ("lora_a_stacked", "lora_b_stacked")
RECORDING_ID = (1 << 31) - 1  # the id of the recording LoRAModel (vLLM wants one > 0)


def linear_layers(manager: Any) -> dict[str, Any]:
    """vLLM's LoRA-wrapped linear layers (the ones with slot tensors), by module name."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    return {n: m for n, m in manager.modules.items() if isinstance(m, BaseLinearLayerWithLoRA)}


def slot_tensors(manager: Any) -> dict[str, torch.Tensor]:
    """Every slot tensor of the linear layers: ``{module}.lora_a_stacked.{slice}`` ..."""
    out = {}
    for name, layer in linear_layers(manager).items():
        for stack in STACKS:
            for i, t in enumerate(getattr(layer, stack)):
                out[f"{name}.{stack}.{i}"] = t
    return out


def _mapper(manager: Any) -> Any:
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    return mapper.get_rename_mapper() if mapper is not None else None


def peft_helper(adapter: AdapterSpec, lora_config: Any) -> Any:
    """vLLM's PEFTHelper of ``adapter``, validated against the engine's LoRA config
    (rank against ``max_lora_rank``, features vLLM does not implement)."""
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(adapter.config)
    try:
        helper.validate_legal(lora_config)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter (r={adapter.rank}, targets {list(adapter.targets)}) "
                         f"does not fit this engine (max_lora_rank="
                         f"{lora_config.max_lora_rank}): {exc}") from None
    return helper


def check_adapter(manager: Any, adapter: AdapterSpec) -> Any:
    """The adapter's PEFTHelper; ValueError naming every parameter the engine has no LoRA
    slot for (a target module vLLM does not wrap), or a rank it cannot hold."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    helper = peft_helper(adapter, manager.lora_config)
    layers = linear_layers(manager)
    held = set(layers)
    for packed, subs in manager.packed_modules.items():
        if packed in layers:
            held.update(subs)
    problems = []
    for p in adapter.params:
        try:
            module, _ = parse_fine_tuned_lora_name(p.name, _mapper(manager))
        except ValueError as exc:
            problems.append(f"{p.name}: {exc}")
            continue
        if module not in held:
            problems.append(f"{p.name}: module {module!r} has no LoRA slot in this engine")
    if problems:
        targets = sorted({n.rsplit(".", 1)[-1] for n in held})
        raise ValueError(f"LoRA adapter targets modules the engine's LoRA config cannot hold "
                         f"(slots exist for {targets}; an adapter of another base model?):"
                         "\n  " + "\n  ".join(problems))
    return helper


def adapter_scaling(helper: Any, adapter: AdapterSpec) -> dict[str, float]:
    """Per ``lora_B`` parameter, the factor vLLM's load folds into B (``optimize``):
    PEFTHelper's ``alpha/r`` (``alpha/sqrt(r)`` for rsLoRA, per-module patterns)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    out = {}
    for p in adapter.params:
        peft_module, is_a = parse_fine_tuned_lora_name(p.name)
        if not is_a:
            out[p.name] = float(helper.get_rank_and_scaling(peft_module)[1])
    return out


class _Sink:
    """The recording tensors' ``copy_`` sink: which slot tensor, which strided view."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.by_storage = {t.untyped_storage().data_ptr(): (n, t) for n, t in tensors.items()}
        self.copies: list[tuple[str, Any, torch.Tensor]] = []  # (slot tensor, key, dst view)
        self.copied: set[str] = set()

    def accept_copy(self, dest: torch.Tensor, src: Any) -> torch.Tensor:
        hit = self.by_storage.get(dest.untyped_storage().data_ptr())
        if hit is None:
            raise ValueError(f"vLLM's set_lora copies {src._name} into a tensor that is no "
                             f"LoRA slot tensor (shape {tuple(dest.shape)})")
        self.copies.append((hit[0], src._key(), dest))
        self.copied.add(src._name)
        return dest


def _recording_model(manager: Any, adapter: AdapterSpec, sink: _Sink) -> Any:
    """A vLLM LoRAModel whose tensors are recording tensors, packed by vLLM."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import FakeRDTTensor
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights
    from vllm.lora.utils import parse_fine_tuned_lora_name

    loras: dict[str, Any] = {}
    dtype = manager.lora_config.lora_dtype
    for p in adapter.params:
        module, is_a = parse_fine_tuned_lora_name(p.name, _mapper(manager))
        fake = FakeRDTTensor(name=p.name, shape=torch.Size(p.shape), dtype=dtype,
                             device=torch.device("meta"), sink=sink)
        lw = loras.setdefault(module, LoRALayerWeights(module, adapter.rank, adapter.alpha,
                                                       None, None, scaling=1.0))
        if is_a:
            lw.lora_a = fake
        else:
            lw.lora_b = fake
    model = LoRAModel(RECORDING_ID, adapter.rank, loras)  # never registered in vLLM
    manager._create_merged_loras_inplace(model)  # vLLM's packing (scaling 1: no multiply)
    return model


def _underfilled(tensors: dict[str, torch.Tensor], pieces: list[Piece],
                 shapes: dict[str, tuple[int, ...]], rank: int) -> list[str]:
    """Slot tensors the adapter fills only in part: vLLM's ``set_lora`` copies into
    ``slot[:rows, :cols]`` of the adapter's own shape, so an adapter of a smaller base
    (fewer input features, fewer output rows) would load silently, with zeros beside it.
    A rank-``r`` version fills ``r`` whole rows of ``lora_a`` and ``r`` whole columns of
    ``lora_b``."""
    written: dict[str, int] = {}
    source: dict[str, str] = {}
    for p in pieces:
        written[p.dst_tensor] = written.get(p.dst_tensor, 0) + p.nbytes
        source.setdefault(p.dst_tensor, p.src_param)
    out = []
    for dst, nbytes in sorted(written.items()):
        t = tensors[dst]
        rows, cols = t.shape[-2:]
        want = rank * (cols if ".lora_a_stacked." in dst else rows)
        got = nbytes // t.element_size()
        if got != want:
            src = source[dst]
            out.append(f"{src} {shapes[src]}: fills {got} of the {want} elements a rank-{rank} "
                       f"adapter fills in {dst} (slot {rows}x{cols})")
    return out


def record_slot(manager: Any, slot: int, adapter: AdapterSpec) -> list[Piece]:
    """The pieces of ``adapter`` in slot ``slot``, recorded from vLLM's ``set_lora``
    (see the module docstring). Zeroes the slot."""
    tensors = slot_tensors(manager)
    sink = _Sink(tensors)
    model = _recording_model(manager, adapter, sink)
    for name, layer in linear_layers(manager).items():
        lw = manager._get_lora_layer_weights(model, name)
        if lw is None:
            continue
        try:
            layer.set_lora(slot, lw.lora_a, lw.lora_b)  # as activate_adapter calls it
        except NotImplementedError as exc:  # an op the recording tensors cannot replay
            raise ValueError(f"{name} ({type(layer).__name__}): vLLM's set_lora cannot be "
                             f"recorded at this TP size: {exc}") from None
    shapes = {p.name: tuple(p.shape) for p in adapter.params}
    pieces: list[Piece] = []
    written: list[Piece] = []  # what is written: a narrow lora_B as one padded piece
    misfits = []
    for dst, (src, ops), view in sink.copies:
        rect, view_shape = rect_of_chain(shapes[src], ops, name=src)
        if [n for n in view_shape if n != 1] != [n for n in view.shape if n != 1]:
            misfits.append(f"{src} {shapes[src]}: a {tuple(view_shape)} block into a "
                           f"{tuple(view.shape)} view of {dst}")
            continue
        dtype = str(view.dtype).removeprefix("torch.")
        runs = copy_pieces(src=src, rect=rect, view_shape=view_shape, dst=dst, dst_dtype=dtype,
                           offset=view.storage_offset(), shape=tuple(view.shape),
                           stride=tuple(view.stride()))
        pieces += runs
        written += padded_rows(runs, src=src, rect=rect, dst=dst, dtype=dtype, view=view)
    misfits += _underfilled(tensors, pieces, shapes, adapter.rank)
    if misfits:
        raise ValueError("LoRA adapter of another base model: its shapes do not fit this "
                         "engine's layers (per TP rank):\n  " + "\n  ".join(misfits))
    unused = sorted(set(shapes) - sink.copied)
    if unused:
        raise ValueError(f"vLLM's set_lora writes no byte of adapter parameters {unused} "
                         "(no LoRA layer of this engine takes them)")
    log.info("recorded %d pieces of %d adapter parameters into LoRA slot %d (%d writes)",
             len(pieces), len(shapes), slot, len(written))
    return written


def padded_rows(runs: list[Piece], *, src: str, rect: tuple, dst: str, dtype: str,
                view: torch.Tensor) -> list[Piece]:
    """``runs`` (the contiguous runs of one ``set_lora`` copy), or one ``PAD_COLS`` piece
    for them where the copy fills the left ``r`` columns of whole rows ``W`` wide (a rank-r
    ``lora_B`` in a ``max_lora_rank``-wide slot: one write of the rows, zeros on the right,
    where vLLM's ``set_lora`` leaves zeros, instead of one write per row)."""
    dims = [(n, st) for n, st in zip(view.shape, view.stride(), strict=True) if n != 1]
    spans = [(a, b) for a, b in rect if b - a != 1]
    if len(runs) < 2 or len(dims) != 2 or len(spans) != 2 or dims[1][1] != 1:
        return runs
    (rows, width), (cols, _) = dims  # width: the row stride, the slot's max_lora_rank
    if width <= cols or [b - a for a, b in spans] != [rows, cols]:
        return runs
    return [Piece(dst_tensor=dst, dst_offset=view.storage_offset() * view.element_size(),
                  nbytes=rows * width * view.element_size(), dst_dtype=dtype, src_param=src,
                  src_slice=tuple(rect), transform=Transform.PAD_COLS)]
