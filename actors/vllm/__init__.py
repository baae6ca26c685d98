"""The Ray side of a real vLLM engine: launch, per-rank handles, served and shadow modes.

What runs inside vLLM's own processes lives in :mod:`weight_transfer.engines.vllm`.
"""
