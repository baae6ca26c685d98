"""vLLM's chat-template warm-up warning is dropped where no tokenizer is used by design
(``skip_tokenizer_init=True``), and only there (weight_transfer.engines.vllm.plugin)."""

from __future__ import annotations

import logging

from weight_transfer.engines.vllm.plugin import NO_TOKENIZER, WARMUP_LOGGER, NoTokenizerWarmup


def _record(msg: str, exc: BaseException | None) -> logging.LogRecord:
    info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(WARMUP_LOGGER, logging.WARNING, __file__, 1, msg, (), info)


def test_only_the_no_tokenizer_warmup_failure_is_dropped():
    keep = NoTokenizerWarmup().filter
    assert not keep(_record("Chat template warmup failed", ValueError(NO_TOKENIZER)))
    assert keep(_record("Chat template warmup failed", ValueError("jinja2: bad template")))
    assert keep(_record("Chat template warmup failed", None))
    assert keep(_record("something else", ValueError(NO_TOKENIZER)))


def test_the_filter_sits_on_vllms_logger_once(monkeypatch):
    import sys
    import types

    factory = types.SimpleNamespace(_registry={"wt_onesided": object()})
    module = types.ModuleType("vllm.distributed.weight_transfer.factory")
    module.WeightTransferEngineFactory = factory
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", module)
    from weight_transfer.engines.vllm.plugin import register

    log = logging.getLogger(WARMUP_LOGGER)
    before = list(log.filters)
    try:
        register()
        register()
        assert sum(isinstance(f, NoTokenizerWarmup) for f in log.filters) == 1
    finally:
        log.filters[:] = before
