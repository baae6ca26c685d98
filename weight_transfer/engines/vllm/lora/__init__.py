"""LoRA adapters written one-sided into vLLM's own adapter slots.

* :mod:`.spec` - plain data between trainers and workers (the adapter, the recorded slots);
* :mod:`.record` - in a worker: which bytes of which adapter parameter land where, recorded
  from vLLM's own ``set_lora``;
* :mod:`.slots` - in a worker: two pinned slots per served adapter, flipped by id;
* :mod:`.link` - in the driver: set up, begin, flip, roll back.

The trainer side is :mod:`weight_transfer.sources.lora`. See docs/vllm.md ("LoRA adapters").
"""
