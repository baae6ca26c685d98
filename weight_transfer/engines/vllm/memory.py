"""Which memory the trainers write in a vLLM worker, and how it becomes what vLLM computes with.

Two kinds of layers (decided per module by :func:`reprocessed`):

* **direct**: the engine computes with the loaded parameter itself (norms,
  the input embedding; on GPU also unquantized linear layers): the
  parameter's own storage is registered, and a write is live at once.
* **reprocessed**: vLLM transforms the loaded weight after loading
  (``quant_method.process_weights_after_loading``): on CPU every linear
  layer is repacked for oneDNN / the sgl kernel (the Parameter becomes size
  0) and MoE experts are prepacked; on GPU quantized layers (FP8) and fused
  MoE kernels may shuffle. The trainers write a plain buffer in vLLM's
  loading format (one arena, registered once); at ``finish_weight_update``
  :func:`reprocess` runs vLLM's own post-load processing of those layers on
  a copy of it, exactly as a fresh load does, and copies the result into the
  tensors the kernels hold (their addresses stay; CUDA graphs stay valid).

On CPU the arena costs one extra copy of the dense weights in host memory;
the repack at finish is the price of keeping vLLM's fast CPU kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from weight_transfer.types import TensorSpec

log = logging.getLogger(__name__)

ALIGN = 64
# Quant methods whose processing leaves the loaded GPU tensor as the one computed with.
GPU_DIRECT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


def reprocessed(module: torch.nn.Module, *, on_cpu: bool, lm_head: torch.nn.Module | None
                ) -> bool:
    """True where the engine does not compute with the loaded parameter itself."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return False
    if type(module).__name__ == "VocabParallelEmbedding" and module is not lm_head:
        return False  # the lookup reads .weight; only an output head is repacked
    return on_cpu or type(method).__name__ not in GPU_DIRECT_METHODS


class Arena:
    """One pre-faulted uint8 buffer holding loading-format tensors at aligned offsets."""

    def __init__(self, specs: Iterable[TensorSpec], device: torch.device) -> None:
        self.offsets: dict[str, int] = {}
        self.specs: dict[str, TensorSpec] = {}
        end = 0
        for s in specs:
            self.offsets[s.name], self.specs[s.name] = end, s
            end += -(-s.nbytes // ALIGN) * ALIGN
        self.buffer = torch.zeros(max(end, ALIGN), dtype=torch.uint8, device=device)

    def view(self, name: str) -> torch.Tensor:
        s, off = self.specs[name], self.offsets[name]
        flat = self.buffer[off:off + s.nbytes].view(getattr(torch, s.dtype))
        return flat.view(s.shape) if s.shape else flat.view(())

    def __len__(self) -> int:
        return len(self.specs)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole contiguous tensor ``t`` as uint8 (same memory)."""
    if not t.is_contiguous():
        raise ValueError(f"cannot register a non-contiguous tensor {tuple(t.shape)}")
    return t.detach().reshape(-1).view(torch.uint8)


def loading_format(layer: torch.nn.Module) -> Any:
    """Put a processed layer back into vLLM's loading format (its layerwise reload:
    parameters as ``load_weights`` fills them); returns vLLM's layerwise info, which
    keeps the kernel tensors and their storage for the way back."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import (
        materialize_layer,
        restore_layer_on_meta,
    )
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    info = get_layerwise_info(layer)
    info.kernel_tensors = get_layer_params_buffers(layer)
    info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
    restore_layer_on_meta(layer, info)
    materialize_layer(layer, info)
    return info


def reprocess(layers: dict[torch.nn.Module, dict[str, torch.Tensor]]) -> None:
    """Run vLLM's post-load processing of ``layers`` on their arena views (see the module
    docstring); the kernel tensors keep their storage."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        _copy_and_restore_kernel_tensors,
    )

    with torch.no_grad():
        for layer, views in layers.items():
            info = loading_format(layer)
            for pname, view in views.items():
                getattr(layer, pname).data.copy_(view)
            _process(layer)
            _copy_and_restore_kernel_tensors(layer, info)
            info.reset()


def _process(layer: torch.nn.Module) -> None:
    """vLLM's first-load processing of one layer.

    A fused-MoE method runs its experts' own step (the CPU grouped-GEMM prepack)
    only on the first call; vLLM's reload path skips it, which leaves CPU experts
    unpacked. A first load runs it, so this does too."""
    method = layer.quant_method
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    kernel = getattr(method, "moe_kernel", None)
    method.process_weights_after_loading(layer)
    if kernel is not None:
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(layer)
    if hasattr(layer, "update_param_tp_status"):
        layer.update_param_tp_status()

