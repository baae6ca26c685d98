"""The reprocessing of a shadow flip, done ahead while vLLM serves (vLLM on CPU).

vLLM's post-load processing of a CPU linear layer builds its kernel from the
loaded weight: a packed weight or a oneDNN handle captured by the layer's
``cpu_linear`` function, plus kernel tensors such as the bias. Reprocessing at
the flip (:func:`~.memory.reprocess`) rewrites the layer in place, so it must
run while the engine is paused. Here each layer is processed on a *twin* (a
deep copy of the layer, never called by the model) from the arena, in a thread
of the worker while the engine keeps stepping; the flip then only copies the
twin's kernel tensors into the live ones and takes over the attributes the
processing set (``cpu_linear``): the pause no longer depends on the repacking::

    prep = Prepared(backend._repack, vllm_config)
    prep.start()             # while serving (after the transfer and its check)
    prep.wait(timeout_s)     # True once every twin is processed
    prep.apply()             # at the flip: copies and attribute swaps only

Memory while prepared: one processed copy of the repacked layers (dropped after
the flip: the live layer's old kernel is released then).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import torch

from weight_transfer.engines.vllm.memory import reprocess

log = logging.getLogger(__name__)

_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _twin(layer: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``layer`` with vLLM's reload metadata of the original."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        get_layerwise_info,
    )
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    info = get_layerwise_info(layer)
    twin = copy.deepcopy(layer)
    LAYERWISE_INFO[twin] = LayerReloadingInfo(restore_metadata=info.restore_metadata,
                                              restore_device=info.restore_device)
    return twin


def _attributes(m: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(m).items() if k not in _MODULE_STATE}


class Prepared:
    """See the module docstring."""

    def __init__(self, layers: dict[torch.nn.Module, dict[str, torch.Tensor]],
                 vllm_config: Any) -> None:
        self.layers, self.vllm_config = layers, vllm_config
        self.twins: dict[torch.nn.Module, torch.nn.Module] = {}
        self.changed: dict[torch.nn.Module, dict[str, Any]] = {}
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="wt-prepare-flip", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                for layer, views in self.layers.items():
                    twin = _twin(layer)
                    before = _attributes(twin)
                    reprocess({twin: views})
                    self.changed[layer] = {k: v for k, v in _attributes(twin).items()
                                           if before.get(k, _MISSING) is not v}
                    self.twins[layer] = twin
        except BaseException as exc:  # raised by wait()/apply() in the caller
            self.error = exc
        self.seconds = time.perf_counter() - t0

    def wait(self, timeout_s: float) -> bool:
        if self._thread is None:
            return False
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def apply(self) -> None:
        """The live layers take the twins' kernels (after :meth:`wait`); raises the error
        the preparation met."""
        if self.error is not None:
            raise RuntimeError(f"preparing the flip failed: {self.error!r}") from self.error
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        with torch.no_grad():
            for layer, twin in self.twins.items():
                live_p, live_b = get_layer_params_buffers(layer)
                new_p, new_b = get_layer_params_buffers(twin)
                for live, new in ((live_p, new_p), (live_b, new_b)):
                    for name, t in live.items():
                        if name in new and new[name].shape == t.shape:
                            t.data.copy_(new[name])
                        elif name in new:
                            raise RuntimeError(f"{type(layer).__name__}.{name}: processed "
                                               f"shape {tuple(new[name].shape)} != live "
                                               f"{tuple(t.shape)}")
                for name, value in self.changed[layer].items():
                    setattr(layer, name, value)


_MISSING = object()
