"""The ``vllm.general_plugins`` entry point: register our backend in every vLLM process.

vLLM runs general plugins in the driver, the EngineCore and every worker, so
``WeightTransferConfig(backend="wt_onesided")`` resolves wherever the worker
builds its weight-transfer engine. The class is imported lazily, on first use.

It also quiets one warning that is noise by design: an engine started with
``skip_tokenizer_init=True`` (prompts as token ids, as RL rollouts send them) warms up a
chat template it has no tokenizer for, and vLLM logs the failure with a traceback at every
start. :class:`NoTokenizerWarmup` drops exactly that record; every other one passes.
"""

from __future__ import annotations

import logging

from weight_transfer.engines.vllm import BACKEND_NAME

log = logging.getLogger(__name__)


WARMUP_LOGGER = "vllm.renderers.base"
NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


class NoTokenizerWarmup(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" record when the cause is the tokenizer
    skipped on purpose (``skip_tokenizer_init=True``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Chat template warmup failed"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and NO_TOKENIZER in str(exc))


def register() -> None:
    """Register :class:`~weight_transfer.engines.vllm.backend.OneSidedBackend` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    warmup_log = logging.getLogger(WARMUP_LOGGER)
    if not any(isinstance(f, NoTokenizerWarmup) for f in warmup_log.filters):
        warmup_log.addFilter(NoTokenizerWarmup())

    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(
        BACKEND_NAME, "weight_transfer.engines.vllm.backend", "OneSidedBackend")
    log.debug("registered vLLM weight-transfer backend %s", BACKEND_NAME)
