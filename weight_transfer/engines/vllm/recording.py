"""Record, once, where vLLM's own ``load_weights`` puts every checkpoint slice.

Runs inside a vLLM worker (it needs the live model). The model's parameters are
put back into their loading format on the meta device (vLLM's
``initialize_layerwise_reload``), every parameter's weight loader is wrapped to
say which engine parameter it fills, and ``model.load_weights`` is driven with
vLLM's recording tensors (``FakeRDTTensor``, zero storage): each ``copy_`` the
loaders issue records the op chain applied to the checkpoint tensor and the
strided destination view - the way vLLM's sharded-RDT backend bakes its plan.
Afterwards the model's own tensors are put back untouched::

    layout = record_load(model, checkpoint=[TensorSpec(name=..., shape=..., dtype=...)],
                         device=torch.device("cpu"))
    layout.params    # {engine parameter: TensorSpec in loading format}
    layout.pieces    # Pieces, src_param = checkpoint names, dst_tensor = engine names

An FP8 checkpoint's weights and ``weight_scale_inv`` scales become pieces that
quantize the weight (:mod:`.fp8`).

``record_load`` raises ValueError naming both sides when a checkpoint tensor
is not consumed or an engine parameter is not filled (padding rows at the end
of dimension 0, vLLM's vocabulary padding, are allowed and left out of the
exposed shape: :func:`exposed_shapes`).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_transfer.layout.recording.fp8 import fp8_pieces
from weight_transfer.layout.recording.slices import copy_pieces, rect_of_chain
from weight_transfer.types import Piece, TensorSpec, dtype_size

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedLayout:
    """What ``load_weights`` does with a checkpoint, as plain data."""

    params: dict[str, TensorSpec]  # engine parameter -> loading-format spec
    pieces: tuple[Piece, ...]
    modules: dict[str, str]  # engine parameter -> the module that owns it


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _stamp_loaders(model: torch.nn.Module, sink) -> list:
    """Wrap every loadable tensor's weight loader to stamp ``sink.current``."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    undo = []
    for name, module in model.named_modules():
        for pname, tensor in get_layer_tensors(module).items():
            had = getattr(tensor, "weight_loader", None)
            inner = default_weight_loader if had is None else _get_original_loader(tensor)

            def stamp(*args, _inner=inner, _key=(name, pname), **kwargs):
                sink.current = _key
                try:
                    return _inner(*args, **kwargs)
                finally:
                    sink.current = None

            functools.update_wrapper(stamp, inner)
            tensor.weight_loader = stamp
            undo.append((tensor, had))
    return undo


def _restore(model: torch.nn.Module, undo: list) -> None:
    """Put the kernel tensors back without loading anything (as vLLM's dry run does)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _place_kernel_tensors,
    )

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            if info.kernel_tensors is not None:
                _place_kernel_tensors(layer, info)
            info.reset()
    for tensor, had in undo:
        if had is None:
            del tensor.weight_loader
        else:
            tensor.weight_loader = had
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def _loading_specs(model: torch.nn.Module) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    specs, owners = {}, {}
    for name, module in model.named_modules():
        for pname, t in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            specs[full] = TensorSpec(name=full, shape=tuple(t.shape), dtype=_dtype_name(t.dtype))
            owners[full] = name
    return specs, owners


def record_load(model: torch.nn.Module, *, checkpoint: Sequence[TensorSpec],
                device: torch.device) -> RecordedLayout:
    """Drive ``model.load_weights`` with recording tensors; see the module docstring."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    sink = BakeSink()
    with torch.device(device):
        initialize_layerwise_reload(model)
        specs, owners = _loading_specs(model)
        undo = _stamp_loaders(model, sink)
        try:
            fakes = [(c.name, FakeRDTTensor(name=c.name, shape=torch.Size(c.shape),
                                            dtype=getattr(torch, c.dtype), device=device,
                                            sink=sink)) for c in checkpoint]
            model.load_weights(iter(fakes))
        finally:
            _restore(model, undo)
    shapes = {c.name: tuple(c.shape) for c in checkpoint}
    pieces = []
    for _layer, copies in sink.copies_by_layer.items():
        for c in copies:
            module, pname = c.layer, c.param_name
            dst = f"{module}.{pname}" if module else pname
            src, ops = c.src
            rect, view = rect_of_chain(shapes[src], ops, name=src)
            pieces += copy_pieces(src=src, rect=rect, view_shape=view, dst=dst,
                                  dst_dtype=specs[dst].dtype, offset=c.offset, shape=c.shape,
                                  stride=c.stride)
    pieces = fp8_pieces(pieces, {c.name: c for c in checkpoint})  # FP8 checkpoints
    unused = sorted(set(shapes) - sink.copied_names)
    if unused:
        raise ValueError("vLLM's load_weights consumes no bytes of checkpoint tensors "
                         f"{unused} (the engine has no parameter they fill)")
    log.info("recorded %d pieces into %d engine parameters from %d checkpoint tensors",
             len(pieces), len({p.dst_tensor for p in pieces}), len(checkpoint))
    return RecordedLayout(params=specs, pieces=tuple(pieces), modules=owners)


# Engine parameters a checkpoint may leave out: attention's KV-cache quantization scales
# (quantized models; vLLM keeps its defaults). They are not weights; no trainer holds them.
ENGINE_DEFAULTS = re.compile(r"\.attn\.(q|k|v|prob)_scale$")


def exposed_shapes(layout: RecordedLayout) -> dict[str, TensorSpec]:
    """The engine tensors the plan fills: every loading-format parameter that some piece
    writes, cut to the rows pieces cover when only trailing rows of dimension 0 (vocab
    padding) stay unwritten. ValueError naming the parameter for any other gap, for an
    overlap, or for a parameter that no checkpoint tensor fills (but ``ENGINE_DEFAULTS``)."""
    by_dst: dict[str, list[Piece]] = {}
    for p in layout.pieces:
        by_dst.setdefault(p.dst_tensor, []).append(p)
    problems, out = [], {}
    for name, spec in layout.params.items():
        ranges = sorted((p.dst_offset, p.dst_offset + p.nbytes, p.src_param)
                        for p in by_dst.get(name, ()))
        if not ranges and ENGINE_DEFAULTS.search(name):
            continue
        if not ranges:
            problems.append(f"engine tensor {name} {spec.shape} {spec.dtype}: no checkpoint "
                            "tensor fills it")
            continue
        end = 0
        for a, b, src in ranges:
            if a != end:
                kind = "overlap" if a < end else "gap"
                problems.append(f"engine tensor {name}: {kind} at bytes [{min(a, end)}, "
                                f"{max(a, end)}) (next piece from {src})")
                break
            end = b
        row = spec.nbytes // spec.shape[0] if spec.shape and spec.shape[0] else spec.nbytes
        if end != spec.nbytes and (end % row or not spec.shape):
            problems.append(f"engine tensor {name}: bytes [{end}, {spec.nbytes}) have no "
                            "source and are not whole trailing rows (padding)")
            continue
        rows = end // row if spec.shape else 1
        shape = (rows, *spec.shape[1:]) if spec.shape else spec.shape
        out[name] = TensorSpec(name=name, shape=shape, dtype=spec.dtype)
    if problems:
        raise ValueError("vLLM engine tensors the checkpoint does not fill exactly:\n  "
                         + "\n  ".join(problems))
    assert all(out[n].nbytes % dtype_size(out[n].dtype) == 0 for n in out)
    return out
