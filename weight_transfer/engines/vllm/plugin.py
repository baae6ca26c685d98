"""The ``vllm.general_plugins`` entry point: register our backend in every vLLM process.

vLLM runs general plugins in the driver, the EngineCore and every worker, so
``WeightTransferConfig(backend="wt_onesided")`` resolves wherever the worker
builds its weight-transfer engine. The class is imported lazily, on first use.
"""

from __future__ import annotations

import logging

from weight_transfer.engines.vllm import BACKEND_NAME

log = logging.getLogger(__name__)


def register() -> None:
    """Register :class:`~weight_transfer.engines.vllm.backend.OneSidedBackend` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(
        BACKEND_NAME, "weight_transfer.engines.vllm.backend", "OneSidedBackend")
    log.debug("registered vLLM weight-transfer backend %s", BACKEND_NAME)
