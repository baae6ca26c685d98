"""Our one-sided, statically planned transfer as a vLLM weight-transfer backend.

A vLLM user switches to it with one config value::

    LLM(model=..., weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME))

The ``vllm.general_plugins`` entry point of this package (:mod:`.plugin`)
registers :class:`.backend.OneSidedBackend` under :data:`BACKEND_NAME` in every
vLLM process. The driver side (:class:`.driver.VllmLink`) registers the engine's
memory, reads its metadata and connects NICs through vLLM's own
``init_weight_transfer_engine`` and a mailbox directory (the same host) or a
signed channel (:mod:`.channel`: a ``vllm serve`` server on another host,
driven over vLLM's RL HTTP routes by :mod:`.http_link`; ``AsyncLLM``:
:mod:`.async_link`); an update is ``start_weight_update()``, one-sided writes
by the trainers, ``finish_weight_update(version)`` and a prefix-cache reset.
See docs/vllm.md.

Nothing here imports vLLM or Ray at import time.
"""

BACKEND_NAME = "wt_onesided"
